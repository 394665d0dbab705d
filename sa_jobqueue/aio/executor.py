"""The asyncio worker's executor: one claimed job, from its handler to its outcome.

The same steps, rules and outcomes as the thread worker's
:class:`~sa_jobqueue.worker.executor.JobExecutor` (whose failure, cancel
and hand-back steps it runs through :func:`~sa_jobqueue.aio.bridge.in_greenlet`):

* An ``async def`` handler runs as the job's task. With a second
  parameter it gets an ``AsyncSession`` of the application's
  ``async_sessionmaker``, in a READ COMMITTED transaction: its pending
  writes are flushed, the fenced completion joins them, and both commit or
  neither does. Without one, its completion is buffered and batched.
* A sync handler runs in the worker's bounded thread pool: without a
  session its completion is batched; with one, the thread worker's
  executor runs it whole in the thread, on a ``Session`` of ``sync_bind``.
* The handler's coroutine is cancelled at its deadline, on a cancel asked
  for from another process, and when a stop's ``shutdown_timeout`` passes.
  A cancelled job's writes never commit: its session is rolled back and
  its connection, interrupted mid-statement perhaps, is discarded. A
  deadline's failure is recorded by the watch
  (:mod:`~sa_jobqueue.aio.lease`); a cancel ends the job ``cancelled``; a
  stop records a failed attempt ("interrupted"), retried by the task's
  policy, as River does.
* A job whose session cannot connect is handed back unstarted.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker

from .. import signals
from ..connections import is_fatal_to_connection
from ..errors import JobLostError
from ..results import result_to_store, store_results
from ..runnable import RunnableTask
from ..worker.books import Held
from ..worker.context import WorkerContext
from ..worker.executor import JobExecutor, hand_back, log_pool_exhausted, start_job
from ..worker.failures import Failure, failure_of
from .bridge import in_greenlet
from .job_sessions import AsyncJobSessions
from .watchdog import JobWatch, not_watched

log = logging.getLogger("sa_jobqueue.worker")

__all__ = ["AsyncJobExecutor", "cancel_backend"]


class AsyncJobExecutor:
    """Runs the claimed jobs of one asyncio worker, each in a task of its own."""

    def __init__(
        self,
        ctx: WorkerContext,
        sessions: async_sessionmaker[AsyncSession],
        threads: ThreadPoolExecutor,
        in_thread: JobExecutor | None,
        session_permits: asyncio.Semaphore,
        watch_job: Callable[[AsyncConnection, Any], JobWatch] = not_watched,
    ) -> None:
        self.ctx = ctx
        self.threads = threads
        self.in_thread = in_thread  # runs sync handlers that take a session (None: no sync_bind)
        self.steps = JobExecutor(ctx)  # the shared failure and cancel steps, run in the greenlet
        self.session_permits = session_permits
        self.job_sessions = AsyncJobSessions(sessions)  # connections kept while jobs wait (lease mode)
        self.watch_job = watch_job  # the watchdog's watch of a job's connection while it holds it

    async def run(self, held: Held) -> None:
        """Run one held job to its outcome."""
        try:
            with self.ctx.running_job(held.job):
                if held.cancel_requested:
                    await in_greenlet(self.steps.finish_cancelled, held)  # asked for before it started
                else:
                    await self._run(held)
        finally:
            held.task = None
            held.finished = True
            if held.started is not None:  # how long jobs take decides how far ahead to claim
                self.ctx.pacer.job_ran(time.monotonic() - held.started)

    async def _run(self, held: Held) -> None:
        ctx, job = self.ctx, held.job
        task = ctx.tasks.get(job.task)
        if task is None:
            log.error("worker %s: job %s has unknown task %r", ctx.name, job.id, job.task)
            await in_greenlet(self.steps.record, held, failure_of(job, None, None, ctx.tasks), None, 0.0)
        elif not task.is_async and task.takes_session:
            await self._sync_in_session(held, task)
        elif task.takes_session:
            await self._async_in_session(held, task)
        else:
            await self._without_session(held, task)

    # -- the three paths --------------------------------------------------

    async def _without_session(self, held: Held, task: RunnableTask) -> None:
        """No session: the handler's completion is batched (or a transaction of its own)."""
        self._start(held, task)
        try:
            if task.is_async:
                held.task = asyncio.current_task()
                try:
                    value = await task.run(held.job, None)
                finally:
                    held.task = None
            else:
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(self.threads, contextvars.copy_context().run, task.run, held.job,
                                                   None)
            stored = result_to_store(task, held.repo, value)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and not held.cancelled_by_worker():
                raise
            await self.after_failure(held, task, exc)
            return
        if await self._fenced_late(held):
            return
        duration = time.monotonic() - (held.started or 0.0)
        if task.batch_complete and stored is None:
            self.ctx.completer.add(held.repo, held.job, duration)
            return
        try:
            await in_greenlet(self._complete_alone, held, stored)
        except JobLostError as lost:
            log.warning("worker %s: %s", self.ctx.name, lost)
            self.ctx.books.count("lost")
            return
        except Exception:
            log.exception("worker %s: completing job %s failed; its lease will expire", self.ctx.name, held.job.id)
            return
        self.ctx.books.count("completed")
        self.ctx.books.tally(held.job, "completed")
        signals.send(signals.job_succeeded, self.ctx.sender, job=held.job, duration=duration)

    def _complete_alone(self, held: Held, stored: str | None) -> None:
        self.ctx.books.release(held.job)
        with self.ctx.control() as session:
            _complete(session, held.repo, held.job, stored)

    async def _sync_in_session(self, held: Held, task: RunnableTask) -> None:
        if self.in_thread is None:
            await in_greenlet(self.steps.record, held, Failure(
                f"task {task.name!r} is a sync handler that takes a session: give the AsyncWorker a sync_bind "
                "(an Engine or sessionmaker) for it", task), None, 0.0)
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.threads, contextvars.copy_context().run, self.in_thread.run, held)

    async def _async_in_session(self, held: Held, task: RunnableTask) -> None:
        ctx = self.ctx
        held.connecting_since = time.monotonic()  # a stop meanwhile hands the job back (see lease.stop_claiming)
        try:
            await self.session_permits.acquire()  # the jobs' pool has room for this many sessions
        except asyncio.CancelledError:
            await in_greenlet(hand_back, ctx, [held])  # stopped before it started
            return
        held.connecting_since = time.monotonic()  # the lease mode's watch gives up on a stalled checkout
        try:
            try:
                opened = await self.job_sessions.open()
            except asyncio.CancelledError:
                await in_greenlet(hand_back, ctx, [held])
                return
            except Exception as exc:
                await self.hand_back_unstarted([held], exc)
                return
            finally:
                held.connecting_since = None
            held.backend_pid = opened.pid
            ctx.session_opened(1)
            watch = self.watch_job(opened.connection, opened.driver_connection)
            try:
                await self._attempt(held, task, opened.session, opened.connection, watch)
            finally:
                watch.release()
                ctx.session_opened(-1)
                held.backend_pid = None  # before the connection serves another job: no cancel of its statement
                await self.job_sessions.close(opened)
        finally:
            self.session_permits.release()

    async def _attempt(self, held: Held, task: RunnableTask, session: AsyncSession, connection: AsyncConnection,
                       watch: JobWatch) -> None:
        ctx, repo, job = self.ctx, held.repo, held.job
        self._start(held, task)
        try:
            held.task = asyncio.current_task()
            try:
                stored = result_to_store(task, repo, await task.run(job, session))
                # The handler's pending writes go first, so that their errors
                # count as the handler's failure.
                await session.flush()
            finally:
                held.task = None  # from here on nothing cancels the job: the fence decides
            if await self._fenced_late(held, session):
                return
            ctx.books.release(job)
            await session.run_sync(lambda s: _complete(s, repo, job, stored))
            with watch.in_flight():  # a COMMIT stalled on the network is the watchdog's too
                await session.commit()
        except JobLostError as lost:
            await session.rollback()
            log.warning("worker %s: %s; the handler's writes were rolled back", ctx.name, lost)
            ctx.books.count("lost")
            return
        except BaseException as exc:
            await self.roll_back(session, connection, held.backend_pid, exc)
            if isinstance(exc, asyncio.CancelledError) and not held.cancelled_by_worker():
                raise
            await self.after_failure(held, task, exc)
            return
        ctx.books.count("completed")
        ctx.books.tally(job, "completed")
        signals.send(signals.job_succeeded, ctx.sender, job=job, duration=time.monotonic() - (held.started or 0.0))

    # -- steps ---------------------------------------------------------------

    def _start(self, held: Held, task: RunnableTask) -> None:
        start_job(self.ctx, held, task)

    async def roll_back(self, session: AsyncSession, connection: AsyncConnection, pid: int | None,
                        exc: BaseException) -> None:
        """A job's (or a group's) transaction ended in ``exc``: roll it back. A
        cancelled coroutine's statement is cancelled on the server too (closing
        the connection would not stop it: a statement runs on, holding its
        locks, until it next writes to the socket), and its connection,
        interrupted mid-statement perhaps, is discarded, as one a fatal error
        broke: it never serves the next job."""
        cancelled = isinstance(exc, asyncio.CancelledError)
        if cancelled and pid is not None:
            await cancel_backend(self.ctx, pid)
        if cancelled or is_fatal_to_connection(exc):
            await _discard(connection)
        else:
            await session.rollback()

    async def _fenced_late(self, held: Held, session: AsyncSession | None = None) -> bool:
        """As the thread worker's: True when the outcome was settled elsewhere
        (a deadline), the job was cancelled, or it was interrupted by a stop."""
        if held.timed_out:
            log.warning("worker %s: job %s returned after its deadline; nothing of it commits",
                        self.ctx.name, held.job.id)
        elif held.cancel_requested:
            await in_greenlet(self.steps.finish_cancelled, held)
        elif held.interrupted:
            await self.record_interrupted(held)
        else:
            return False
        if session is not None:
            await session.rollback()
        return True

    async def after_failure(self, held: Held, task: RunnableTask, exc: BaseException) -> None:
        """The handler of ``held`` raised ``exc``: record the failure, unless its outcome is settled already."""
        if await self._fenced_late(held):
            return
        log.info("worker %s: job %s (%s) failed: %r", self.ctx.name, held.job.id, held.job.task, exc)
        duration = time.monotonic() - (held.started or 0.0)
        await in_greenlet(self.steps.record, held, failure_of(held.job, task, exc), exc, duration)

    async def record_interrupted(self, held: Held) -> None:
        """A stop's interrupt cancelled the handler of ``held``: a failed attempt, retried by its task's policy."""
        task = self.ctx.tasks.get(held.job.task)
        failure = Failure(f"interrupted: the worker {self.ctx.name} stopped while the job ran "
                          f"(its shutdown_timeout of {self.ctx.options.shutdown_timeout.total_seconds():g} s passed)",
                          task)
        await in_greenlet(self.steps.record, held, failure, None, time.monotonic() - (held.started or 0.0))

    async def hand_back_unstarted(self, held: list[Held], exc: Exception) -> None:
        """The session of ``held`` (one job, or a group) could not connect: hand them back, unstarted, and back off."""
        ctx, ids = self.ctx, ", ".join(str(h.job.id) for h in held)
        if isinstance(exc, sa_exc.TimeoutError):
            log_pool_exhausted(ctx.name, ids, self.job_sessions.sessions.kw.get("bind"), ctx.sessions_open)
        else:
            log.error("worker %s: job(s) %s could not connect (%r); handed back unstarted", ctx.name, ids, exc)
        ctx.back_off()
        await in_greenlet(hand_back, ctx, held)


async def cancel_backend(ctx: WorkerContext, pid: int) -> None:
    """Cancel the statement the server process ``pid`` runs (``pg_cancel_backend``), logging a failure."""
    def cancel() -> None:
        with ctx.control() as session:
            session.execute(select(func.pg_cancel_backend(pid)))

    try:
        await in_greenlet(cancel)
    except Exception:
        log.exception("worker %s: cancelling the statement of server process %s failed", ctx.name, pid)


def _complete(session: Any, repo: Any, job: Any, stored: str | None) -> None:
    """The fenced completion of ``job``, and its encoded result when there is one (one transaction)."""
    repo.complete(session, job)
    if stored is not None:
        store_results(session, repo.table, {job.id: stored})


async def _discard(connection: AsyncConnection) -> None:
    try:
        await connection.invalidate()
    except Exception:  # pragma: no cover - invalidating a broken connection
        log.debug("discarding a job's connection failed", exc_info=True)
