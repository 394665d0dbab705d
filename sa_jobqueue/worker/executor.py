"""The executor: one claimed job, from its handler to its outcome (lease mode).

The steps, in order:

1. The job gets a fresh session, on the connection its slot holds
   (:mod:`~sa_jobqueue.worker.job_sessions`; READ COMMITTED, whatever the
   engine's default). If it cannot connect (the pool is exhausted, the server refuses), the
   handler never started: the job is handed back without spending its
   attempt, and the worker waits a poll interval before claiming again.
2. The handler runs; its return value must not be an awaitable.
3. Its pending writes are flushed (their errors are the handler's failure),
   and the fenced completion joins them: both commit, or neither does. A
   handler without a session has nothing to commit: its completion goes to
   the :class:`~sa_jobqueue.worker.completer.Completer`.
4. Otherwise the outcome is one of: a failure, recorded in a transaction of
   its own (:mod:`~sa_jobqueue.worker.failures`); a cancel asked for while it
   ran (the job ends ``cancelled``, its writes rolled back); a deadline that
   passed (the watch already recorded the failure: the late return commits
   nothing); a lost lease (the fence refused the completion).

A connection that failed in a way that makes it unusable (a read-only
transaction after a failover, an admin shutdown, a lost connection) is
discarded, not returned to the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .. import signals
from ..connections import backend_pid, is_fatal_to_connection
from ..errors import JobLostError
from ..inflight import ConnectionWatch
from ..results import result_to_store, store_results
from .books import Held
from .context import WorkerContext
from .failures import Failure, failure_of, record_failure, refuse_awaitable

log = logging.getLogger("sa_jobqueue.worker")


class JobExecutor:
    """Runs claimed jobs of one worker; called from its slot threads."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def run(self, held: Held) -> bool:
        """Run one held job to its outcome; True (the slot found work)."""
        job = held.job
        try:
            with self.ctx.running_job(job):
                if held.cancel_requested:
                    self.finish_cancelled(held)  # asked for before it started
                else:
                    self._run(held)
        finally:
            with held.lock:
                held.finished = True
            if held.started is not None:  # how long jobs take decides how far ahead to claim
                self.ctx.pacer.job_ran(time.monotonic() - held.started)
        return True

    def _run(self, held: Held) -> None:
        ctx, repo, job = self.ctx, held.repo, held.job
        task = ctx.tasks.get(job.task)
        if task is None:
            log.error("worker %s: job %s has unknown task %r", ctx.name, job.id, job.task)
            self.record(held, failure_of(job, None, None, ctx.tasks), None, 0.0)
            return
        if task.completes_in_batch:
            self.start(held, task)
            try:
                stored = result_to_store(task, repo, refuse_awaitable(task.run(job, None)))
            except BaseException as exc:  # SystemExit from a handler is a failure too
                self.after_failure(held, task, exc)
                return
            if self.fenced_late(held):
                return
            if stored is None:
                ctx.completer.add(repo, job, time.monotonic() - (held.started or 0.0))
            else:  # a result to store: its completion is not batched
                complete_with_result(ctx, held, stored)
            return
        held.thread = threading.get_ident()
        held.connecting_since = time.monotonic()  # the lease mode's watch gives up on a stalled checkout
        try:
            session, connection = ctx.job_sessions.open(repo.table)
        except Exception as exc:
            with held.lock:
                held.connecting_since = None
                gave_up = held.gave_up
            if not gave_up:
                self.hand_back_unstarted([held], exc)
            return
        with session:
            try:
                self._run_in_session(held, task, session, connection)
            finally:
                with held.lock:  # before the session's connection serves another job or goes back to the pool
                    held.finished = True

    def _run_in_session(self, held: Held, task: Any, session: Session, connection: Any) -> None:
        ctx = self.ctx
        held.backend_pid = backend_pid(connection)
        with held.lock:  # decided once: the watch gave up on this checkout, or it did not
            held.connecting_since = None
            if held.gave_up:
                return  # handed back while the checkout stalled; this thread was replaced
        watch = ctx.watch(connection)
        ctx.session_opened(1)
        try:
            self._attempt(held, task, session, connection, watch)
        finally:
            ctx.session_opened(-1)
            watch.release()

    def _attempt(self, held: Held, task: Any, session: Session, connection: Any, watch: ConnectionWatch) -> None:
        ctx, repo, job = self.ctx, held.repo, held.job
        self.start(held, task)
        try:
            stored = result_to_store(task, repo, refuse_awaitable(task.run(job, session)))
            # The handler's pending writes go first, so that their errors
            # count as the handler's failure.
            session.flush()
            if self.fenced_late(held):
                session.rollback()
                return
            ctx.books.release(job)
            repo.complete(session, job)
            if stored is not None:
                store_results(session, repo.table, {job.id: stored})
            with watch.in_flight():  # a COMMIT stalled on the network is the watchdog's too
                session.commit()
        except JobLostError as lost:
            session.rollback()
            log.warning("worker %s: %s; the handler's writes were rolled back", ctx.name, lost)
            ctx.books.count("lost")
            return
        except BaseException as exc:
            if is_fatal_to_connection(exc):
                connection.invalidate()  # never hand this connection to the next job
            session.rollback()
            self.after_failure(held, task, exc)
            return
        ctx.books.count("completed")
        ctx.books.tally(job, "completed")
        signals.send(signals.job_succeeded, ctx.sender, job=job, duration=time.monotonic() - (held.started or 0.0))

    # -- steps ---------------------------------------------------------------

    def start(self, held: Held, task: Any) -> None:
        """The handler of ``held`` starts in this thread now."""
        held.thread = threading.get_ident()
        start_job(self.ctx, held, task)

    def fenced_late(self, held: Held) -> bool:
        """The handler returned: True when its outcome was already settled
        elsewhere (a deadline that passed), or a cancel was asked for (the
        job ends cancelled here). Either way nothing of it commits."""
        if held.timed_out:
            log.warning("worker %s: job %s returned after its deadline; nothing of it commits",
                        self.ctx.name, held.job.id)
            return True
        if held.cancel_requested:
            self.finish_cancelled(held)
            return True
        return False

    def after_failure(self, held: Held, task: Any, exc: BaseException) -> None:
        """The handler of ``held`` raised ``exc``: record the failure, unless its outcome is settled already."""
        if self.fenced_late(held):
            return
        log.info("worker %s: job %s (%s) failed: %r", self.ctx.name, held.job.id, held.job.task, exc)
        self.record(held, failure_of(held.job, task, exc), exc, time.monotonic() - (held.started or 0.0))

    def record(self, held: Held, failure: Failure, exc: BaseException | None, duration: float) -> None:
        """Record a failed attempt in a transaction of its own; count and signal it."""
        ctx = self.ctx
        ctx.books.release(held.job)
        try:
            with ctx.control() as session:
                outcome = record_failure(session, held.repo, held.job, failure)
        except JobLostError as lost:
            log.warning("worker %s: %s", ctx.name, lost)
            ctx.books.count("lost")
            return
        except Exception:
            log.exception("worker %s: recording the failure of job %s failed; its lease will expire and the "
                          "reaper counts the attempt", ctx.name, held.job.id)
            return
        ctx.books.count(outcome)
        ctx.books.tally(held.job, "failed")
        signals.send_failure(ctx.sender, held.job, exc, outcome, duration)

    def finish_cancelled(self, held: Held) -> None:
        """End a running job whose cancel was asked for: ``cancelled``, fenced."""
        ctx = self.ctx
        ctx.books.release(held.job)
        try:
            with ctx.control() as session:
                held.repo.mark_cancelled(session, held.job)
        except JobLostError as lost:
            log.warning("worker %s: %s", ctx.name, lost)
            ctx.books.count("lost")
            return
        except Exception:
            log.exception("worker %s: cancelling job %s failed; its lease will expire", ctx.name, held.job.id)
            return
        log.info("worker %s: job %s (%s) cancelled while running", ctx.name, held.job.id, held.job.task)
        ctx.books.count("cancelled")
        signals.send(signals.job_cancelled, ctx.sender, job=held.job)

    def hand_back_unstarted(self, held: list[Held], exc: Exception) -> None:
        """The session of ``held`` could not connect: hand them back, unstarted, and back off."""
        ctx, ids = self.ctx, ", ".join(str(h.job.id) for h in held)
        if isinstance(exc, sa_exc.TimeoutError):
            held_here = max(ctx.sessions_open, ctx.job_sessions.held)
            log_pool_exhausted(ctx.name, ids, ctx.sessions.kw.get("bind"), held_here)
        else:
            log.error("worker %s: job(s) %s could not connect (%r); handed back unstarted", ctx.name, ids, exc)
        ctx.back_off()
        hand_back(ctx, held)


def log_pool_exhausted(worker: str, ids: str, bind: Any, held: int) -> None:
    """Jobs ``ids`` got no connection from the jobs' pool (of ``bind``, an
    Engine or AsyncEngine) while this worker's running jobs hold ``held``:
    the pool's own count beside it, so that a leak elsewhere shows as the
    difference (both workers say it so)."""
    pool = getattr(bind, "pool", None)
    log.error(
        "worker %s: job(s) %s could not get a connection: the jobs' pool is exhausted (%s); this worker's "
        "running jobs hold %s of them, so the others are held elsewhere (a handler that keeps a session "
        "open leaks one per job). They are handed back unstarted.",
        worker, ids, pool.status() if pool is not None else "unknown pool", held,
    )


def start_job(ctx: WorkerContext, held: Held, task: Any) -> None:
    """The handler of ``held`` starts now: note when, and its deadline (the
    task's timeout, else the worker's ``job_timeout``); send ``job_started``."""
    now = time.monotonic()
    held.started = now
    timeout = task.timeout or ctx.options.job_timeout
    if timeout is not None:
        held.deadline = now + timeout.total_seconds()
    signals.send(signals.job_started, ctx.sender, job=held.job)


def hand_back(ctx: WorkerContext, held: list[Held]) -> int:
    """Give unstarted jobs back (pending, attempt not counted); return how many were.

    Jobs whose hand back fails (the server refuses the worker's connections
    too) stay held, their leases extended, and are handed back again later
    (:meth:`WorkerContext.hand_back_later`): a failed hand back must not
    leave them to the reaper, which would count the attempt they never used.
    """
    total = 0
    for repo in {id(h.repo): h.repo for h in held}.values():
        mine = [h for h in held if h.repo is repo]
        # Released first, so that a heartbeat between the hand back and the
        # release does not take a job handed back for a lost lease.
        for h in mine:
            ctx.books.release(h.job)
        try:
            with ctx.control() as session:
                total += len(repo.hand_back(session, [h.job for h in mine]))
        except Exception as exc:
            log.error("worker %s: handing back %s job(s) failed (%r); trying again shortly", ctx.name, len(mine), exc)
            ctx.hand_back_later([ctx.books.hold(h.repo, h.job) for h in mine])  # their leases extended meanwhile
    ctx.books.count("handed_back", total)
    return total


def complete_with_result(ctx: WorkerContext, held: Held, stored: str) -> None:
    """Complete a job without a session of its own, with its encoded result, in a transaction of its own."""
    job = held.job
    ctx.books.release(job)
    try:
        with ctx.control() as session:
            held.repo.complete(session, job)
            store_results(session, held.repo.table, {job.id: stored})
    except JobLostError as lost:
        log.warning("worker %s: %s", ctx.name, lost)
        ctx.books.count("lost")
        return
    except Exception:
        log.exception("worker %s: completing job %s failed; its lease will expire", ctx.name, job.id)
        return
    ctx.books.count("completed")
    ctx.books.tally(job, "completed")
    signals.send(signals.job_succeeded, ctx.sender, job=job, duration=time.monotonic() - (held.started or 0.0))
