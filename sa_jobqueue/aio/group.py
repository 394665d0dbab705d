"""Grouped commits in the asyncio worker's lease mode: several short jobs in one transaction.

The asyncio counterpart of :class:`~sa_jobqueue.worker.group.GroupRunner`,
with its rules (read its module docstring, and docs/concepts.md, "Grouped
commits"): the jobs of ``group_commit`` tasks with an ``async def`` handler
(which takes the job's ``AsyncSession``) that one claim brings run in groups
(:func:`~sa_jobqueue.worker.group.group_sizes`), each group one task of
:class:`~sa_jobqueue.aio.slots.JobSlots` holding one session, and so one of
the ``max_sessions`` permits: each handler in turn, one flush, one fenced
``complete_many``, one COMMIT. When anything goes wrong the whole
transaction rolls back; the job to blame is settled alone and every other
job of the group runs again alone, exactly as an ungrouped job runs
(:meth:`~sa_jobqueue.aio.executor.AsyncJobExecutor.run`). So a grouped
handler runs twice at most, and its writes commit once. A sync handler that
takes a session runs in a thread, one job per transaction, as without the
option.

While the handlers run, every job's ``held.task`` is the group's task: its
deadline, a cancel asked for it and a stop's interrupt
(:mod:`~sa_jobqueue.aio.lease`) cancel the group's coroutine. The group then
cancels its statement on the server, discards its connection (interrupted
mid-statement perhaps) and settles each job by what was asked of it: timed
out (the watch records the failure), cancelled, or, the one whose handler
ran at a stop's interrupt, an interrupted attempt; the others run again
alone.

At a stop a group runs no further handler: the jobs whose handlers ran
commit, and the others, as every job still to run again alone, are handed
back unstarted (nothing of them committed; their attempt is not spent). A
group stopped, or stalled, while it waits for its session is handed back
whole.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from .. import signals
from ..runnable import RunnableTask
from ..worker.books import Held
from ..worker.context import WorkerContext
from ..worker.executor import JobExecutor, hand_back, start_job
from ..worker.group import count_lost, is_grouped
from .bridge import in_greenlet
from .job_sessions import AsyncJobSessions
from .watchdog import JobWatch

log = logging.getLogger("sa_jobqueue.worker")

__all__ = ["AsyncGroupRunner", "runs_grouped"]


def runs_grouped(tasks: Any, job: Any) -> bool:
    """Whether the asyncio worker's lease mode runs ``job`` in a group: its
    task has ``group_commit`` and an ``async def`` handler."""
    return is_grouped(tasks, job) and bool(tasks.get(job.task).is_async)


class Executor(Protocol):
    """What groups need of :class:`~sa_jobqueue.aio.executor.AsyncJobExecutor`."""

    ctx: WorkerContext
    job_sessions: AsyncJobSessions
    session_permits: asyncio.Semaphore
    steps: JobExecutor
    watch_job: Callable[[AsyncConnection, Any], JobWatch]

    async def run(self, held: Held) -> None: ...
    async def roll_back(self, session: AsyncSession, connection: AsyncConnection, pid: int | None,
                        exc: BaseException) -> None: ...
    async def after_failure(self, held: Held, task: RunnableTask, exc: BaseException) -> None: ...
    async def record_interrupted(self, held: Held) -> None: ...
    async def hand_back_unstarted(self, held: list[Held], exc: Exception) -> None: ...


class AsyncGroupRunner:
    """Runs groups of held jobs of one table, each of a ``group_commit`` task, each group as a task."""

    def __init__(self, executor: Executor, stopping: asyncio.Event) -> None:
        self.executor = executor
        self.ctx = executor.ctx
        self.stopping = stopping  # set at a stop: no further handler starts, nothing runs again alone

    async def run(self, group: list[Held]) -> None:
        """Run every job of ``group`` to its outcome (a slot's task)."""
        todo = [h for h in group if not h.cancel_requested]
        for held in group:
            if held.cancel_requested:  # asked for before it started: ends cancelled, alone
                await self.executor.run(held)
        again = await self._run(todo) if len(todo) > 1 else todo
        for index, held in enumerate(again):
            if self.stopping.is_set():
                await self._hand_back(again[index:], "the worker stops; none of their writes committed")
                return
            held.finished = False  # its own run now: its deadline is watched again
            await self.executor.run(held)
            _uncancel()

    async def _run(self, group: list[Held]) -> list[Held]:
        """Run ``group`` in one transaction; return the jobs to run again alone."""
        leader, permits = group[0], self.executor.session_permits
        leader.connecting_since = time.monotonic()  # a stop meanwhile hands the group back (lease.stop_claiming)
        try:
            await permits.acquire()  # one session for the whole group, so one permit
        except asyncio.CancelledError:
            leader.connecting_since = None
            await self._hand_back(group, "stopped while waiting for a session")
            return []
        try:
            return await self._in_session(group)
        finally:
            permits.release()  # before any job runs again alone: it needs a permit of its own

    async def _in_session(self, group: list[Held]) -> list[Held]:
        ctx, leader = self.ctx, group[0]
        leader.connecting_since = time.monotonic()  # the lease mode's watch gives up on a stalled checkout
        sessions = self.executor.job_sessions
        try:
            opened = await sessions.open()
        except asyncio.CancelledError:  # a stop, or the checkout stalled: all of the group goes back
            await self._hand_back(group, "its session was given up on while connecting")
            return []
        except Exception as exc:
            await self.executor.hand_back_unstarted(group, exc)
            return []
        finally:
            leader.connecting_since = None
        for held in group:
            held.backend_pid = opened.pid
        ctx.session_opened(1)
        watch = self.executor.watch_job(opened.connection, opened.driver_connection)
        try:
            return await self._attempt(group, opened.session, opened.connection, watch)
        finally:
            watch.release()
            ctx.session_opened(-1)
            for held in group:  # before the connection serves another job: no cancel of its statement
                held.task = held.backend_pid = None
                held.finished = True
            await sessions.close(opened)

    async def _attempt(self, group: list[Held], session: AsyncSession, connection: AsyncConnection,
                       watch: JobWatch) -> list[Held]:
        ctx, repo, pid = self.ctx, group[0].repo, group[0].backend_pid
        started, ran = time.monotonic(), []
        current: Held | None = None  # the job whose handler runs
        try:
            for held in group:
                held.task = asyncio.current_task()  # its deadline, its cancel, a stop: the group's
            for held in group:
                if self.stopping.is_set():
                    break  # no further handler: what ran commits, the rest is handed back
                task = ctx.tasks.get(held.job.task)
                assert task is not None  # the claim grouped the job for its task's group_commit
                start_job(ctx, held, task)
                current = held
                with self.ctx.running_job(held.job):
                    await task.run(held.job, session)
                current = None
                ran.append(held)
                if not held.timed_out:
                    # Its deadline bounds its handler: the later handlers of
                    # the group are not its own time.
                    held.deadline = None
            if ran:
                await session.flush()
        except BaseException as exc:  # SystemExit from a handler is a failure too
            for held in group:
                held.task = None
            await self.executor.roll_back(session, connection, pid, exc)
            ours = any(h.cancelled_by_worker() for h in group)
            if isinstance(exc, asyncio.CancelledError) and not ours:
                raise  # the caller's (a stop at once): nothing more is recorded
            if ours:  # the worker cancelled the group (whatever the handler made of it): blame nobody else
                _uncancel()
                return await self._cancelled(group, current)
            if current is not None:
                return await self._failed(group, current, exc)
            log.info("worker %s: a group of %s jobs rolled back at its flush (%r); each runs again alone",
                     ctx.name, len(group), exc)
            return await self._unsettled(group)
        for held in group:
            held.task = None  # from here on nothing cancels the group: the fence decides
        if any(h.cancelled_by_worker() for h in group):  # asked for as the handlers ended: nothing commits
            await session.rollback()
            return await self._cancelled(group, None)
        rest = group[len(ran):]
        if not ran:
            return rest
        for held in ran:
            ctx.books.release(held.job)
        try:
            done = await session.run_sync(lambda s: repo.complete_many(s, [h.job for h in ran]))
            if len(done) < len(ran):
                await session.rollback()
                return await self._lost(ran, done) + rest
            with watch.in_flight():  # a COMMIT stalled on the network is the watchdog's too
                await session.commit()
        except BaseException as exc:  # the completion or the COMMIT: no handler to blame
            await self.executor.roll_back(session, connection, pid, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise  # nobody but the caller cancels the group here
            log.info("worker %s: a group of %s jobs rolled back (%r); each runs again alone", ctx.name,
                     len(ran), exc)
            return await self._unsettled(ran) + rest
        ctx.books.count("completed", len(ran))
        each = (time.monotonic() - started) / len(ran)
        for held in ran:
            ctx.pacer.job_ran(each)
            ctx.books.tally(held.job, "completed")
            signals.send(signals.job_succeeded, ctx.sender, job=held.job,
                         duration=time.monotonic() - (held.started or started))
        return rest

    async def _cancelled(self, group: list[Held], current: Held | None) -> list[Held]:
        """The worker cancelled the group (a deadline, a cancel, a stop's
        interrupt), which may have hit another job's handler: the job whose
        handler ran at the interrupt records an interrupted attempt, the others
        are sorted out by what was asked of each."""
        if current is not None and current.interrupted and not (current.timed_out or current.cancel_requested):
            with self.ctx.running_job(current.job):
                await self.executor.record_interrupted(current)
            group = [h for h in group if h is not current]
        return await self._unsettled(group)

    async def _failed(self, group: list[Held], culprit: Held, exc: BaseException) -> list[Held]:
        """A handler of the group raised: its failure is recorded alone; the others run again."""
        task = self.ctx.tasks.get(culprit.job.task)
        assert task is not None
        with self.ctx.running_job(culprit.job):
            await self.executor.after_failure(culprit, task, exc)
        rest = [h for h in group if h is not culprit]
        log.info("worker %s: job %s failed in a group; the group's other %s job(s) run again alone",
                 self.ctx.name, culprit.job.id, len(rest))
        return await self._unsettled(rest)

    async def _lost(self, group: list[Held], done: set[int]) -> list[Held]:
        """The fence refused some completions (their leases had expired): those are lost; the others run again."""
        return await self._unsettled(count_lost(self.ctx, group, done))

    async def _unsettled(self, held_jobs: list[Held]) -> list[Held]:
        """Of jobs whose group rolled back, those to run again alone: not the
        ones timed out (the watch records their failure) nor those whose
        cancel was asked for (they end cancelled here)."""
        again = []
        for held in held_jobs:
            if held.timed_out:
                continue
            held.started = held.deadline = None  # its deadline starts again with its next run
            if held.cancel_requested:
                with self.ctx.running_job(held.job):
                    await in_greenlet(self.executor.steps.finish_cancelled, held)
                continue
            self.ctx.books.keep(held)  # released for the group's completion: its lease extended again
            again.append(held)
        return again

    async def _hand_back(self, held: list[Held], why: str) -> None:
        """Jobs of a group that did not run, or whose writes rolled back, go back unstarted."""
        count = await in_greenlet(hand_back, self.ctx, held)
        log.info("worker %s: a group's %s job(s) handed back unstarted (%s): %s", self.ctx.name, count, why,
                 ", ".join(str(h.job.id) for h in held))


def _uncancel() -> None:
    """The worker's own cancel of this task was handled and the task goes on:
    take it back (Python 3.11 counts a task's cancels; asyncio.timeout and
    TaskGroup read the count)."""
    task = asyncio.current_task()
    if sys.version_info >= (3, 11) and task is not None:
        while task.uncancel():
            pass
