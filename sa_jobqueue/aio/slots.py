"""JobSlots: the asyncio tasks of a worker's claimed jobs, at most ``concurrency`` running.

The asyncio counterpart of :class:`sa_jobqueue.worker.slots.Slots`: a
claimed job waits in the ready queue until fewer than ``concurrency`` jobs
run, then runs as a task of its own. What a caller may rely on:

* ``len()`` counts the jobs held: ready and running;
* :meth:`take_results` reports how many jobs ended since the last call;
* :meth:`take_unstarted` empties the ready queue (for a hand back);
* :meth:`wait_idle` returns once nothing runs, or at its timeout;
* ``on_done`` is called once a job's task ended (a slot is free).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
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
        self, concurrency: int, run: Callable[[Held], Coroutine[Any, Any, None]], on_done: Callable[[], None]
    ) -> None:
        self.concurrency = concurrency
        self._run = run
        self._on_done = on_done
        self._ready: deque[Held] = deque()
        self.running: dict[asyncio.Task[None], Held] = {}
        self._ended = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._ready) + len(self.running)

    def submit(self, held: Held) -> None:
        self._ready.append(held)
        self._start_ready()

    def take_results(self) -> tuple[int, int]:
        """Jobs ended since the last call, and jobs held now."""
        ended, self._ended = self._ended, 0
        return ended, len(self)

    def take_unstarted(self) -> list[Held]:
        """Empty the ready queue: the jobs claimed whose task never started."""
        unstarted = list(self._ready)
        self._ready.clear()
        return unstarted

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no job to run; True when none runs."""
        return not self.running or await wait_set(self._idle, timeout)

    def _start_ready(self) -> None:
        while self._ready and len(self.running) < self.concurrency:
            held = self._ready.popleft()
            name = f"sa_jobqueue-job-{held.job.id}"
            task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._run(held), name=name)
            self.running[task] = held
            self._idle.clear()
            task.add_done_callback(self._ended_task)

    def _ended_task(self, task: asyncio.Task[None]) -> None:
        held = self.running.pop(task, None)
        self._ended += 1
        if not task.cancelled() and task.exception() is not None:
            # The executor handles every outcome; this is a bug in it, never a job's failure.
            log.error("job %s: its task ended with an error", getattr(held and held.job, "id", "?"),
                      exc_info=task.exception())
        self._start_ready()
        if not self.running:
            self._idle.set()
        self._on_done()
