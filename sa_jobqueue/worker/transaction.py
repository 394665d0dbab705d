"""Transaction mode: a batch is claimed, run and finished in one transaction.

Each slot claims a batch in a transaction that holds the row locks, runs
each job in its own SAVEPOINT (a failure rolls back only its job, and is
recorded in a SAVEPOINT of its own, so that even a failure that cannot be
recorded as asked leaves the batch usable), completes the succeeded jobs
in one statement and commits once. Consecutive jobs of ``group_commit``
tasks share one SAVEPOINT instead (see :meth:`TransactionMode._run_group`).
A crash rolls everything back: the rows are simply pending again.

At a graceful stop, a batch runs no further job: the jobs it claimed but
did not start are handed back in its transaction (their attempt not
counted), and it commits what ran.

Deadlines: past a job's deadline the worker cancels the batch's statement on
the server, and the job's SAVEPOINT is rolled back and its failure recorded
as "timed out after N s" whatever the handler returns. A handler that still
has not returned a grace later (a hang in Python) holds the batch's
transaction: its thread is given up on and replaced, and the batch's
connection is terminated, which rolls the batch back (its jobs are pending
again, their attempts not counted, as after any crash in this mode).

A batch whose session stalls in the pool's checkout (a pre-ping on a
half-open path, which the watchdog cannot see) for ``stall_timeout`` is
given up: its thread is replaced, and since it claimed nothing, nothing is
handed back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .. import signals
from ..connections import backend_pid, is_fatal_to_connection
from ..results import result_to_store, store_results
from .batch_report import BatchReport
from .books import Held
from .context import READ_COMMITTED, WorkerContext
from .deadlines import check_stuck, grace
from .failures import failure_of, record_failure, refuse_awaitable, timeout_failure
from .group import batch_parts, is_grouped
from .slots import Slots

log = logging.getLogger("sa_jobqueue.worker")


class TransactionMode:
    """The transaction-mode strategy of a worker's loop."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.slots = Slots(ctx.options.concurrency, name="sa_jobqueue", on_done=lambda _: ctx.wake.set())
        self._running: dict[int, Held] = {}  # the job each slot thread runs, by thread
        self._connecting: dict[int, float] = {}  # by slot thread: when its batch's checkout began
        self._given_up: set[int] = set()  # slot threads replaced while their checkout stalled
        self._lock = threading.Lock()

    # -- the loop's step -----------------------------------------------------

    def step(self, now: float, *, listening: bool, until_empty: bool) -> bool:
        """Take results, start the probes the pacer asks for; True when drained (until_empty)."""
        pacer = self.ctx.pacer
        ran, empty, inflight = self.slots.take_results()
        pacer.results(now, hits=ran, misses=empty, claiming=0, ran=ran, listening=listening, probing=inflight)
        if until_empty and pacer.drained(busy=bool(inflight or len(self.ctx.completer))):
            return True
        for _ in range(pacer.probes(now, free=self.ctx.options.concurrency - inflight)):
            self.slots.submit(self.run_batch)
        return False

    def sleep(self, now: float, deadline: float) -> float:
        stall = self.ctx.options.stall_timeout
        with self._lock:
            due = [h.deadline + (grace(h) if h.timed_out else 0.0) for h in self._running.values()
                   if h.deadline is not None]
            if stall is not None:
                due += [since + stall.total_seconds() for since in self._connecting.values()]
        return self.ctx.pacer.sleep(now, busy=len(self.slots) > 0, deadline=min([deadline, *due]))

    def watch(self, now: float) -> None:
        """Cancel the statements of jobs past their deadline; end batches stuck past the grace;
        give up on batches stalled in their session's checkout."""
        stall = self.ctx.options.stall_timeout
        if stall is not None:
            self._give_up_connecting(now, stall.total_seconds())
        with self._lock:
            running = list(self._running.values())
        for held in running:
            if held.deadline is None or held.finished:
                continue
            if not held.timed_out and now >= held.deadline:
                with held.lock:
                    if not held.finished:
                        held.timed_out = True
                        self._signal_backend(held, "pg_cancel_backend")
            elif held.timed_out and now >= held.deadline + grace(held) and held.thread is not None:
                with held.lock:
                    if held.finished or not self.slots.abandon(held.thread):
                        continue
                    self._signal_backend(held, "pg_terminate_backend")  # ends the batch's transaction
                log.error("worker %s: job %s (%s) is still running %g s past its deadline; its batch is rolled "
                          "back and its thread replaced (%s stuck so far)", self.ctx.name, held.job.id,
                          held.job.task, grace(held), self.slots.stuck)
        check_stuck(self.ctx, self.slots)

    def _give_up_connecting(self, now: float, stall: float) -> None:
        """A batch's session stalled in the pool's checkout (a pre-ping on a
        half-open path, before the batch holds the connection, so the
        watchdog cannot see it): replace its thread. The batch has claimed
        nothing, so nothing is handed back; if the checkout ever returns, its
        thread gives the connection back and ends (:meth:`_connect`)."""
        with self._lock:  # decided here or by the thread leaving its checkout, never both
            for ident, since in self._connecting.items():
                if now - since < stall or ident in self._given_up:
                    continue
                if self.slots.abandon(ident, stuck=False):
                    self._given_up.add(ident)
                    log.error("worker %s: a batch's session has waited %.0f s for a connection; its thread is "
                              "replaced and the batch given up before it claimed anything", self.ctx.name, stall)

    def _signal_backend(self, held: Held, function: str) -> None:
        if held.backend_pid is None:
            return
        try:
            with self.ctx.control() as session:
                session.execute(select(getattr(func, function)(held.backend_pid)))
        except Exception:
            log.exception("worker %s: %s for job %s failed", self.ctx.name, function, held.job.id)

    # -- one batch -----------------------------------------------------------

    def run_batch(self) -> bool:
        """Claim a batch and run it in one transaction; False when nothing was claimable."""
        ctx = self.ctx
        with ctx.sessions() as session:
            session.begin()
            connection = self._connect(session)
            if connection is None:
                return False
            watch = ctx.watch(connection)
            try:
                batch = self._run_batch(session, backend_pid(connection))
                with watch.in_flight():  # a COMMIT stalled on the network is the watchdog's too
                    session.commit()
            except BaseException as exc:
                if is_fatal_to_connection(exc):
                    connection.invalidate()  # a read-only or dead connection must not serve the next batch
                    ctx.back_off()
                raise  # the session's close rolls the batch back
            finally:
                watch.release()
        if batch is None:
            return False
        batch.settle(ctx)  # committed: now count, and tell the receivers
        return True

    def _connect(self, session: Session) -> Connection | None:
        """The batch's READ COMMITTED connection; None when it has none: the
        pool is exhausted, or the checkout stalled and :meth:`watch` gave up
        on it (this thread was replaced meanwhile)."""
        ctx, ident = self.ctx, threading.get_ident()
        with self._lock:
            self._connecting[ident] = time.monotonic()
        connection: Connection | None = None
        try:
            connection = session.connection(execution_options=READ_COMMITTED)
        except sa_exc.TimeoutError:
            pool = getattr(ctx.sessions.kw.get("bind"), "pool", None)
            log.error("worker %s: a batch could not get a connection: the jobs' pool is exhausted (%s); this "
                      "worker's batches hold %s of them, so the others are held elsewhere (a handler that keeps "
                      "a session open leaks one per job)", ctx.name,
                      pool.status() if pool is not None else "unknown pool", len(self.slots) - 1)
            ctx.back_off()
        finally:
            with self._lock:
                del self._connecting[ident]
                replaced = ident in self._given_up
                self._given_up.discard(ident)
        return None if replaced else connection

    def _run_batch(self, session: Session, pid: int | None) -> BatchReport | None:
        """Claim and run one batch on ``session``'s transaction; None when nothing was claimable."""
        ctx = self.ctx
        for repo in ctx.rotation():
            queues = ctx.queues_for(repo)
            if not queues:  # every queue of this table is paused
                continue
            jobs = repo.claim(session, queues=queues, limit=ctx.options.batch_size or 1,
                              worker=ctx.name, lease=ctx.options.lease)
            if jobs:
                break
        else:
            return None
        batch = BatchReport()
        for is_group, part in batch_parts(jobs, lambda job: is_grouped(self.ctx.tasks, job)):
            if is_group:
                self._run_group(session, repo, part, pid, batch)
            else:
                self._run_one(session, repo, part[0], pid, batch)
        batch.finish(session, repo)
        return batch

    def _run_one(self, session: Session, repo: Any, job: Any, pid: int | None, batch: BatchReport) -> None:
        """Run one job of the batch in a SAVEPOINT of its own (unless stopping) and report it."""
        if self.ctx.stopping.is_set():
            batch.unstarted.append(job)
            return
        started = time.monotonic()
        with self.ctx.running_job(job):
            outcome, error = self._run_in_savepoint(session, repo, job, pid)
        batch.ran(job, outcome, error, time.monotonic() - started)

    def _run_group(self, session: Session, repo: Any, group: list[Any], pid: int | None, batch: BatchReport) -> None:
        """Run ``group`` (jobs of group_commit tasks) under one SAVEPOINT instead of one each.

        When a handler fails or passes its deadline, the SAVEPOINT is rolled
        back: that job's failure is recorded alone, and every other job of the
        group runs again (or for the first time) in a SAVEPOINT of its own. A
        failure at the group's flush blames nobody: each job runs again alone.
        """
        ctx = self.ctx
        savepoint = session.begin_nested()
        ran: list[tuple[Any, float]] = []
        results: dict[int, str] = {}
        culprit: tuple[Any, Any, Held | None, BaseException | None, float] | None = None
        for job in group:
            if ctx.stopping.is_set():
                break
            task = ctx.tasks.get(job.task)
            assert task is not None  # a group holds jobs of known group_commit tasks only
            signals.send(signals.job_started, ctx.sender, job=job)
            timeout = task.timeout or ctx.options.job_timeout
            held = None if timeout is None else self._start(repo, job, pid, timeout.total_seconds())
            started, error = time.monotonic(), None
            try:
                with self.ctx.running_job(job):
                    stored = result_to_store(task, repo, refuse_awaitable(task.run(job, session)))
                if stored is not None:
                    results[job.id] = stored
            except BaseException as exc:  # SystemExit from a handler is a failure too
                error = exc
            finally:
                self._finished(held)
            if error is not None or (held is not None and held.timed_out):
                culprit = (job, task, held, error, time.monotonic() - started)
                break
            ran.append((job, time.monotonic() - started))
        rest = group[len(ran) + (culprit is not None):]
        if culprit is None:
            try:
                store_results(session, repo.table, results)
                savepoint.commit()  # flushes the group's writes
            except Exception as exc:
                savepoint.rollback()
                rest = batch.group_failed_at_flush(ctx.name, ran, exc) + rest
            else:
                for job, duration in ran:
                    batch.ran(job, None, None, duration)
        else:
            savepoint.rollback()
            job, task, held, error, duration = culprit
            with self.ctx.running_job(job):
                outcome = self._record(session, repo, job, task, held, error)
            batch.ran(job, outcome, error, duration)
            rest = [job for job, _ in ran] + rest
        for job in rest:
            self._run_one(session, repo, job, pid, batch)

    def _run_in_savepoint(
        self, session: Session, repo: Any, job: Any, pid: int | None
    ) -> tuple[str | None, BaseException | None]:
        """Run one job of a batch in a SAVEPOINT: (None, None) on success, else
        the job's new status as recorded in the batch, and the handler's exception."""
        ctx = self.ctx
        task = ctx.tasks.get(job.task)
        if task is None:
            log.error("worker %s: job %s has unknown task %r", ctx.name, job.id, job.task)
            return record_failure(session, repo, job, failure_of(job, None, None, ctx.tasks), savepoint=True), None
        signals.send(signals.job_started, ctx.sender, job=job)
        timeout = task.timeout or ctx.options.job_timeout
        if timeout is None:  # nothing to watch: the common case stays as cheap as it was
            return self._attempt(session, repo, job, task, None)
        held = self._start(repo, job, pid, timeout.total_seconds())
        try:
            return self._attempt(session, repo, job, task, held)
        finally:
            self._finished(held)

    def _finished(self, held: Held | None) -> None:
        """The job's handler returned: its deadline no longer applies."""
        if held is None:
            return
        with held.lock:  # before the connection runs the batch's next statement
            held.finished = True
        with self._lock:
            self._running.pop(threading.get_ident(), None)

    def _attempt(
        self, session: Session, repo: Any, job: Any, task: Any, held: Held | None
    ) -> tuple[str | None, BaseException | None]:
        savepoint = session.begin_nested()
        error: BaseException | None = None
        try:
            stored = result_to_store(task, repo, refuse_awaitable(task.run(job, session)))
            if held is None or not held.timed_out:
                if stored is not None:  # kept through the batch's completion; notified at its commit
                    store_results(session, repo.table, {job.id: stored})
                savepoint.commit()  # flushes the handler's writes inside the savepoint
                return None, None
        except BaseException as exc:  # SystemExit from a handler is a failure too
            error = exc
        savepoint.rollback()
        return self._record(session, repo, job, task, held, error), error

    def _record(
        self, session: Session, repo: Any, job: Any, task: Any, held: Held | None, error: BaseException | None
    ) -> str:
        """Record the failure of ``job``, whose writes were rolled back: its
        timeout when it passed its deadline (whatever it returned or raised),
        else ``error``; return its new status."""
        ctx = self.ctx
        if held is not None and held.timed_out:
            assert held.deadline is not None and held.started is not None
            seconds = held.deadline - held.started
            log.error("worker %s: job %s (%s) timed out after %g s", ctx.name, job.id, job.task, seconds)
            return record_failure(session, repo, job, timeout_failure(task, seconds), savepoint=True)
        assert error is not None
        log.info("worker %s: job %s (%s) failed: %r", ctx.name, job.id, job.task, error)
        return record_failure(session, repo, job, failure_of(job, task, error), savepoint=True)

    def _start(self, repo: Any, job: Any, pid: int | None, seconds: float) -> Held:
        now = time.monotonic()
        held = Held(repo, job, started=now, deadline=now + seconds, backend_pid=pid, thread=threading.get_ident())
        with self._lock:
            self._running[held.thread or 0] = held
        return held

    # -- stopping ----------------------------------------------------------------

    def stop_claiming(self, until: float) -> None:
        """Batches see ``stopping`` and hand back what they did not start; probes
        not started yet are dropped."""
        self.slots.take_unstarted()

    def describe_running(self) -> str:
        return (f"{len(self.slots)} batch(es) still running; their transactions roll back when the process "
                "exits, and their jobs are pending again")

    def close(self, *, wait: bool) -> None:
        self.slots.close(wait=wait)
