"""JobSlots: the asyncio tasks of a worker's claimed jobs, at most ``concurrency`` running.

The asyncio counterpart of :class:`sa_jobqueue.worker.slots.Slots`: a
claimed job waits in the ready queue until fewer than ``concurrency`` tasks
run, then runs as a task of its own; a group of jobs (grouped commits,
:mod:`~sa_jobqueue.aio.group`) is one item and one task, run by
``run_group``. What a caller may rely on:

* ``len()`` counts the jobs held: ready and running, a group by its jobs;
  :meth:`jobs_wait` tells whether any is ready and not running;
* :meth:`take_results` reports how many tasks ended since the last call;
* :meth:`take_unstarted` empties the ready queue (for a hand back), groups
  taken apart into their jobs;
* ``running`` maps each task to its job, or to a group's first job, whose
  ``followers`` are the others; :meth:`members` yields every job of them;
* :meth:`wait_idle` returns once nothing runs, or at its timeout;
* ``on_done`` is called once a task ended (a slot is free).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from ..worker.books import Held

log = logging.getLogger("sa_jobqueue.worker")

__all__ = ["JobSlots", "wait_set"]


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True when it is set."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


class JobSlots:
    """Ready and running jobs of one asyncio worker (see the module docstring)."""

    def __init__(
        self, concurrency: int, run: Callable[[Held], Coroutine[Any, Any, None]], on_done: Callable[[], None],
        run_group: Callable[[list[Held]], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self.concurrency = concurrency
        self._run = run
        self._run_group = run_group
        self._on_done = on_done
        self._ready: deque[Held | list[Held]] = deque()
        self.running: dict[asyncio.Task[None], Held] = {}
        self._held = 0  # the jobs ready and running
        self._ended = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return self._held

    def submit(self, held: Held | list[Held]) -> None:
        """Queue a job, or a group of jobs run by ``run_group`` in one task."""
        self._ready.append(held)
        self._held += len(held) if isinstance(held, list) else 1
        self._start_ready()

    def jobs_wait(self) -> bool:
        """Whether claimed jobs wait in the ready queue for a task to run them."""
        return bool(self._ready)

    def take_results(self) -> tuple[int, int]:
        """Tasks ended since the last call (a group's is one), and jobs held now."""
        ended, self._ended = self._ended, 0
        return ended, len(self)

    def take_unstarted(self) -> list[Held]:
        """Empty the ready queue: the jobs claimed whose task never started."""
        unstarted = [h for item in self._ready for h in (item if isinstance(item, list) else [item])]
        self._ready.clear()
        self._held -= len(unstarted)
        return unstarted

    def members(self) -> Iterator[tuple[asyncio.Task[None], Held]]:
        """Each running task with each job it runs: its job, or every job of its group."""
        for task, held in list(self.running.items()):
            yield task, held
            for follower in held.followers:
                yield task, follower

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no job to run; True when none runs."""
        return not self.running or await wait_set(self._idle, timeout)

    def _start_ready(self) -> None:
        while self._ready and len(self.running) < self.concurrency:
            item = self._ready.popleft()
            if isinstance(item, list):
                assert self._run_group is not None  # groups are submitted only with a run_group
                held, run = item[0], self._run_group(item)
                held.followers = tuple(item[1:])
                name = f"sa_jobqueue-group-{held.job.id}"
            else:
                held, run = item, self._run(item)
                name = f"sa_jobqueue-job-{held.job.id}"
            task: asyncio.Task[None] = asyncio.get_running_loop().create_task(run, name=name)
            self.running[task] = held
            self._idle.clear()
            task.add_done_callback(self._ended_task)

    def _ended_task(self, task: asyncio.Task[None]) -> None:
        held = self.running.pop(task, None)
        self._ended += 1
        if held is not None:
            self._held -= 1 + len(held.followers)
        if not task.cancelled() and task.exception() is not None:
            # The executor handles every outcome; this is a bug in it, never a job's failure.
            log.error("job %s: its task ended with an error", getattr(held and held.job, "id", "?"),
                      exc_info=task.exception())
        self._start_ready()
        if not self.running:
            self._idle.set()
        self._on_done()
