"""The asyncio worker's transaction mode: a batch claimed, run and finished in one transaction.

As in the thread worker (:mod:`sa_jobqueue.worker.transaction`), and with
its :class:`~sa_jobqueue.worker.batch_report.BatchReport`: up to
``concurrency`` batches at once, each a task holding one ``AsyncSession``
of the application's; the batch's claim holds the row locks until it
commits; each job runs in a SAVEPOINT (a failure rolls back only its job,
and is recorded in the batch); the succeeded jobs complete in one
statement and everything commits once. A crash rolls everything back:
the rows are simply pending again. Consecutive jobs of ``group_commit``
tasks share one SAVEPOINT, as in the thread worker.

Handlers: an ``async def`` one gets the batch's ``AsyncSession`` when it
takes a session; a sync one that takes a session runs on the batch's
``Session`` through ``run_sync``, on the event loop (keep it short: it
holds the loop while it computes); a sync one without runs in the thread
pool.

Deadlines: past a job's deadline its statement on the server is cancelled
(``pg_cancel_backend``: the statement fails inside the job's SAVEPOINT,
which rolls back cleanly), and a grace later a handler still running is
cancelled. Either way the job's SAVEPOINT is rolled back and its failure
recorded as "timed out after N s". A coroutine cancelled while it waited
on the driver leaves the connection unusable: then the whole batch rolls
back, as after a crash.

At a graceful stop a batch runs no further job: the jobs it claimed but
did not start are handed back in its transaction; at the shutdown timeout
the batches still running are cancelled, and roll back.
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
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker

from .. import signals
from ..connections import driver_backend_pid, is_fatal_to_connection
from ..results import result_to_store, store_results
from ..runnable import RunnableTask
from ..worker.batch_report import BatchReport
from ..worker.context import READ_COMMITTED, WorkerContext
from ..worker.failures import failure_of, record_failure, refuse_awaitable, timeout_failure
from ..worker.group import batch_parts, is_grouped
from .executor import cancel_backend
from .slots import wait_set
from .watchdog import JobWatch, not_watched

log = logging.getLogger("sa_jobqueue.worker")

__all__ = ["AsyncTransactionMode"]

# How long after cancelling its statement a handler may still run before its coroutine is cancelled.
_CANCEL_GRACE = 1.0


class _Timeout(Exception):
    """A handler of the batch passed its deadline."""


class AsyncTransactionMode:
    """The transaction-mode strategy of the asyncio worker's loop."""

    def __init__(self, ctx: WorkerContext, sessions: async_sessionmaker[AsyncSession], threads: ThreadPoolExecutor,
                 stopping: asyncio.Event, wake: Callable[[], None],
                 watch_job: Callable[[AsyncConnection, Any], JobWatch] = not_watched) -> None:
        self.ctx = ctx
        self.wake = wake
        self.sessions = sessions
        self.threads = threads
        self.stopping = stopping
        self.watch_job = watch_job  # the watchdog's watch of a batch's connection while it holds it
        # The batches in flight, each with when its session's checkout began while it waits for it.
        self.running: dict[asyncio.Task[bool], float | None] = {}
        self._next_connect_check = 0.0
        self._ran = self._empty = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- the loop's step -----------------------------------------------------

    def step(self, now: float, *, listening: bool, until_empty: bool) -> bool:
        """Take results, start the probes the pacer asks for; True when drained (until_empty)."""
        pacer = self.ctx.pacer
        ran, empty, self._ran, self._empty = self._ran, self._empty, 0, 0
        inflight = len(self.running)
        pacer.results(now, hits=ran, misses=empty, claiming=0, ran=ran, listening=listening, probing=inflight)
        if until_empty and pacer.drained(busy=bool(inflight or len(self.ctx.completer))):
            return True
        for _ in range(pacer.probes(now, free=self.ctx.options.concurrency - inflight)):
            batch = asyncio.get_running_loop().create_task(self.run_batch(), name="sa_jobqueue-batch")
            self.running[batch] = now
            self._idle.clear()
            batch.add_done_callback(self._batch_done)
        return False

    def _batch_done(self, batch: asyncio.Task[bool]) -> None:
        self.running.pop(batch, None)
        if batch.cancelled() or batch.exception() is not None:
            if not batch.cancelled():
                log.error("worker %s: a batch failed and was rolled back: %r", self.ctx.name, batch.exception())
                self.ctx.back_off()
            self._empty += 1
        elif batch.result():
            self._ran += 1
        else:
            self._empty += 1
        if not self.running:
            self._idle.set()
        self.wake()

    def watch(self, now: float) -> float:
        """Give up on batches stalled in their session's checkout; the
        handlers' deadlines are the batches' own (see :meth:`_call`)."""
        stall = self.ctx.options.stall_timeout
        if stall is not None and now >= self._next_connect_check:
            self._next_connect_check = now + 1.0  # once a second: its timeout is counted in seconds
            self._give_up_connecting(now, stall.total_seconds())
        return float("inf")

    def _give_up_connecting(self, now: float, stall: float) -> None:
        """A batch's session stalled in the pool's checkout (a pre-ping on a
        half-open path, before the batch holds the connection, so the
        watchdog cannot see it): cancel it. It has claimed nothing yet, so
        nothing is handed back; the next batch checks out another connection."""
        for batch, since in list(self.running.items()):
            if since is not None and now - since >= stall:
                self.running[batch] = None
                log.error("worker %s: a batch's session has waited %.0f s for a connection; the batch is given "
                          "up before it claimed anything", self.ctx.name, stall)
                batch.cancel()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no batch to run; True when none runs."""
        return not self.running or await wait_set(self._idle, timeout)

    # -- one batch -----------------------------------------------------------

    async def run_batch(self) -> bool:
        """Claim a batch and run it in one transaction; False when nothing was claimable."""
        ctx = self.ctx
        async with self.sessions() as session:
            try:
                connection = await session.connection(execution_options=READ_COMMITTED)
                raw = await connection.get_raw_connection()
                current = asyncio.current_task()
                if current in self.running:
                    self.running[current] = None  # connected: the watchdog watches it from here
            except sa_exc.TimeoutError:
                log.error("worker %s: a batch could not get a connection: the jobs' pool is exhausted", ctx.name)
                ctx.back_off()
                return False
            pid = driver_backend_pid(raw.driver_connection)
            watch = self.watch_job(connection, raw.driver_connection)
            try:
                batch = await self._run_batch(session, pid)
                with watch.in_flight():  # a COMMIT stalled on the network is the watchdog's too
                    await session.commit()
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError) or is_fatal_to_connection(exc):
                    await connection.invalidate()  # interrupted or dead: never serve the next batch
                raise  # the session's close rolls the batch back
            finally:
                watch.release()
        if batch is None:
            return False
        batch.settle(ctx)
        return True

    async def _run_batch(self, session: AsyncSession, pid: int | None) -> BatchReport | None:
        ctx = self.ctx
        for repo in ctx.rotation():
            jobs: list[Any] = await session.run_sync(self._claim, repo)
            if jobs:
                break
        else:
            return None
        batch = BatchReport()
        for is_group, part in batch_parts(jobs, lambda job: is_grouped(self.ctx.tasks, job)):
            if is_group:
                await self._run_group(session, repo, part, pid, batch)
            else:
                await self._run_one(session, repo, part[0], pid, batch)
        await session.run_sync(batch.finish, repo)
        return batch

    async def _run_one(self, session: AsyncSession, repo: Any, job: Any, pid: int | None, batch: BatchReport) -> None:
        """Run one job of the batch in a SAVEPOINT of its own (unless stopping) and report it."""
        if self.stopping.is_set():
            batch.unstarted.append(job)
            return
        started = time.monotonic()
        with self.ctx.running_job(job):
            outcome, error = await self._run_in_savepoint(session, repo, job, pid)
        batch.ran(job, outcome, error, time.monotonic() - started)

    async def _run_group(
        self, session: AsyncSession, repo: Any, group: list[Any], pid: int | None, batch: BatchReport
    ) -> None:
        """Run ``group`` (jobs of group_commit tasks) under one SAVEPOINT, as the
        thread worker does (:meth:`~sa_jobqueue.worker.transaction.TransactionMode._run_group`):
        a failure or a deadline rolls the group back, records that job alone and
        runs the others in a SAVEPOINT each; a failed flush runs each alone."""
        ctx = self.ctx
        savepoint = await session.begin_nested()
        ran: list[tuple[Any, float]] = []
        results: dict[int, str] = {}
        culprit: tuple[Any, RunnableTask, Exception | None, float] | None = None  # error None: the deadline passed
        for job in group:
            if self.stopping.is_set():
                break
            task = ctx.tasks.get(job.task)
            assert task is not None  # a group holds jobs of known group_commit tasks only
            signals.send(signals.job_started, ctx.sender, job=job)
            timeout = task.timeout or ctx.options.job_timeout
            started = time.monotonic()
            try:
                with self.ctx.running_job(job):
                    value = await self._call(task, job, session, None if timeout is None else timeout.total_seconds(),
                                             pid)
                stored = result_to_store(task, repo, value)
                if stored is not None:
                    results[job.id] = stored
            except _Timeout:
                culprit = (job, task, None, time.monotonic() - started)
                break
            except Exception as exc:
                culprit = (job, task, exc, time.monotonic() - started)
                break
            ran.append((job, time.monotonic() - started))
        rest = group[len(ran) + (culprit is not None):]
        if culprit is None:
            try:
                await session.run_sync(store_results, repo.table, results)
                await savepoint.commit()  # flushes the group's writes
            except Exception as exc:
                await savepoint.rollback()
                rest = batch.group_failed_at_flush(ctx.name, ran, exc) + rest
            else:
                for job, duration in ran:
                    batch.ran(job, None, None, duration)
        else:
            await savepoint.rollback()
            job, task, error, duration = culprit
            with self.ctx.running_job(job):
                outcome = await self._record(session, repo, job, task, error)
            batch.ran(job, outcome, error, duration)
            rest = [job for job, _ in ran] + rest
        for job in rest:
            await self._run_one(session, repo, job, pid, batch)

    def _claim(self, session: Any, repo: Any) -> list[Any]:
        ctx = self.ctx
        queues = ctx.queues_for(repo)
        if not queues:  # every queue of this table is paused
            return []
        jobs: list[Any] = repo.claim(session, queues=queues, limit=ctx.options.batch_size or 1,
                                     worker=ctx.name, lease=ctx.options.lease)
        return jobs

    async def _run_in_savepoint(
        self, session: AsyncSession, repo: Any, job: Any, pid: int | None
    ) -> tuple[str | None, BaseException | None]:
        """One job of a batch in a SAVEPOINT: (None, None) on success, else its new status and the error."""
        ctx = self.ctx
        task = ctx.tasks.get(job.task)
        if task is None:
            log.error("worker %s: job %s has unknown task %r", ctx.name, job.id, job.task)
            failure = failure_of(job, None, None, ctx.tasks)
            return await session.run_sync(record_failure, repo, job, failure, savepoint=True), None
        signals.send(signals.job_started, ctx.sender, job=job)
        timeout = task.timeout or ctx.options.job_timeout
        savepoint = await session.begin_nested()
        error: Exception | None = None
        try:
            value = await self._call(task, job, session, None if timeout is None else timeout.total_seconds(), pid)
            stored = result_to_store(task, repo, value)
            if stored is not None:  # kept through the batch's completion; notified at its commit
                await session.run_sync(store_results, repo.table, {job.id: stored})
            await savepoint.commit()  # flushes the handler's writes inside the savepoint
            return None, None
        except _Timeout:
            error = None
        except Exception as exc:
            error = exc
        await savepoint.rollback()
        return await self._record(session, repo, job, task, error), error

    async def _record(
        self, session: AsyncSession, repo: Any, job: Any, task: RunnableTask, error: Exception | None
    ) -> str:
        """Record the failure of ``job``, whose writes were rolled back: ``error``,
        or its timeout when None; return its new status."""
        ctx = self.ctx
        if error is None:
            timeout = task.timeout or ctx.options.job_timeout
            assert timeout is not None
            seconds = timeout.total_seconds()
            log.error("worker %s: job %s (%s) timed out after %g s", ctx.name, job.id, job.task, seconds)
            failure = timeout_failure(task, seconds)
        else:
            log.info("worker %s: job %s (%s) failed: %r", ctx.name, job.id, job.task, error)
            failure = failure_of(job, task, error)
        status: str = await session.run_sync(record_failure, repo, job, failure, savepoint=True)
        return status

    async def _call(self, task: RunnableTask, job: Any, session: AsyncSession, seconds: float | None,
                    pid: int | None) -> Any:
        """Run the handler (as a task of its own when it has a deadline) and return what it returned;
        raise :class:`_Timeout` when the deadline passed, whatever it did."""
        if not task.is_async and task.takes_session:
            call: Any = session.run_sync(lambda s: refuse_awaitable(task.run(job, s)))
        elif not task.is_async:
            call = asyncio.get_running_loop().run_in_executor(
                self.threads, contextvars.copy_context().run, lambda: refuse_awaitable(task.run(job, None)))
        else:
            call = task.run(job, session)
        if seconds is None:
            return await call
        handler = asyncio.ensure_future(call)
        done, _ = await asyncio.wait({handler}, timeout=seconds)
        if not done:
            if pid is not None:
                await cancel_backend(self.ctx, pid)  # the statement fails inside the SAVEPOINT
            done, _ = await asyncio.wait({handler}, timeout=_CANCEL_GRACE)
            if not done:
                handler.cancel()
                await asyncio.wait({handler})
            if not handler.cancelled():
                handler.exception()  # retrieved: whatever it raised, the deadline decides
            raise _Timeout
        return handler.result()  # its own error, if any

    # -- stopping ----------------------------------------------------------------

    async def stop_claiming(self, until: float) -> None:
        """Batches see the stop and hand back what they did not start."""

    def interrupt(self) -> int:
        """The shutdown timeout passed: cancel the batches still running (they roll back)."""
        for batch in list(self.running):
            batch.cancel()
        return len(self.running)

    async def settle(self, timeout: float) -> None:
        """The run ends with batches in flight: cancel them (they roll back) and
        wait up to ``timeout`` for them to end."""
        self.interrupt()
        await self.wait_idle(timeout)

    async def release_connections(self) -> None:
        """The worker's end: nothing is kept between batches (each holds a session of its own)."""

    def describe_running(self) -> str:
        return (f"{len(self.running)} batch(es) still running; their transactions roll back, and their jobs are "
                "pending again")
