"""Lease mode: claims commit at once; each job then runs in its own transaction.

Claims run in claimer threads (up to CLAIMERS at once, so that the server
works on the next batch while this one runs) on the worker's own
autocommit connections; the claimed jobs are held (their leases extended
by the heartbeat) and queued for the slot threads, where the
:class:`~sa_jobqueue.worker.executor.JobExecutor` runs each.

This module also owns what happens to a held job from outside its thread:

* a deadline that passes: stop extending the lease, cancel the job's
  statement on the server, record the failure ("timed out after N s"); a
  slot still stuck in the handler after a grace is given up on and
  replaced, and past ``max_stuck_slots`` the worker stops with
  :class:`~sa_jobqueue.WorkerStuckError` so that its supervisor restarts it;
* a cancel asked for from another process (learned at the heartbeat or at
  once through NOTIFY): the job is told (``job.cancel_requested_at``) and
  ends ``cancelled`` when its handler returns, or at its deadline;
* a graceful stop: the jobs claimed but not started are handed back at
  once, fenced, without spending their attempt.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, func, select

from ..connections import send_on_own
from .books import Held
from .context import WorkerContext
from .deadlines import check_stuck, grace, record_timeout
from .executor import JobExecutor, hand_back
from .group import GroupRunner, group_sizes
from .heartbeat import heartbeat, request_cancel
from .held import HeldConnections
from .options import CLAIMERS
from .slots import Slots

log = logging.getLogger("sa_jobqueue.worker")


def claim_on(repo: Any, connection: Connection, params: dict[str, Any]) -> list[Any]:
    """Claim with ``params`` on ``connection``, one of the worker's own engine
    that a claimer keeps across claims (autocommit: the claim commits at once).
    A connection the claim's error left unusable is invalidated, so that its
    keeper replaces it at the next claim (a read-only one after a failover
    would fail every claim it is kept for; one interrupted mid-statement
    cannot serve the next)."""
    return send_on_own(connection, lambda own: repo.claimer.claim_on(own, params))


class LeaseMode:
    """The lease-mode strategy of a worker's loop."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.executor = JobExecutor(ctx)
        self.groups = GroupRunner(self.executor)
        self.slots = Slots(ctx.options.concurrency, name="sa_jobqueue", on_done=self._slot_done,
                           on_idle=ctx.job_sessions.release)
        # Each claimer thread holds a connection of the worker's own engine
        # for its life: a claim after an idle wait is what a notified job
        # waits for, and a checkout and a session per claim cost as much as
        # the claim's own round trip there.
        engine = ctx.control.engine
        self._held = HeldConnections(engine) if engine is not None else None
        self.claimers = Slots(CLAIMERS, name="sa_jobqueue-claim", on_done=self._claim_done,
                              on_exit=self._held.release if self._held is not None else None)
        self._overdue: list[Held] = []  # timed out, their handler not returned yet
        self._next_hand_back = 0.0
        self._next_due = float("inf")  # the earliest deadline the latest watch saw

    # -- the loop's step -----------------------------------------------------

    def step(self, now: float, *, listening: bool, until_empty: bool) -> bool:
        """Take results, send the claims the pacer asks for; True when drained (until_empty)."""
        pacer = self.ctx.pacer
        # Claimers first: a claim that ends after its snapshot counts as in
        # flight, and one that ended before has handed its jobs to the slots,
        # whose snapshot comes next.
        hits, misses, claiming = self.claimers.take_results()
        ran, _, held = self.slots.take_results()
        pacer.results(now, hits=hits, misses=misses, claiming=claiming, ran=ran, listening=listening)
        for ask in pacer.claims(now, held=held, claiming=claiming):
            pacer.claim_sent(ask)
            self.claimers.submit(self._claim_into, ask)
        busy = bool(held or claiming or len(self.claimers) or len(self.ctx.completer))
        return until_empty and pacer.drained(busy=busy)

    def sleep(self, now: float, deadline: float) -> float:
        # The deadlines as of this iteration's watch, which scanned the held
        # jobs already (a job that starts after it is seen at the next wake,
        # as one that starts while the loop sleeps).
        return self.ctx.pacer.sleep(now, busy=False, deadline=min(deadline, self._next_due))

    def _slot_done(self, active: int) -> None:
        """A slot finished a job: wake the loop when it may claim again."""
        if self.ctx.pacer.wants_claim(active + self.ctx.pacer.reserved):
            self.ctx.wake.set()

    def _claim_done(self, active: int) -> None:
        """A claim ended. If a notification came while it was out, the claim
        it calls for goes at once from this thread; the loop wakes either way."""
        if self.ctx.pacer.woken:
            self.ctx.step_now(False)
        self.ctx.wake.set()

    def _claim_into(self, ask: int) -> bool:
        """A claimer thread: claim up to ``ask`` jobs and queue them for the slots."""
        ctx, got, took = self.ctx, 0, 0.0
        seconds: float | None = None  # the claims' time, for the pacer's sense of a short job
        try:
            for repo in ctx.rotation():
                if got >= ask:
                    break
                queues = ctx.queues_for(repo)
                if not queues:  # every queue of this table is paused
                    continue
                start = time.monotonic()
                jobs = self._claim(repo, queues, ask - got)
                took += time.monotonic() - start
                got += len(jobs)  # committed: ours now
                self._submit(repo, jobs)
            seconds = took
        except Exception:
            log.exception("worker %s: claim failed; retrying after a pause", ctx.name)
            ctx.back_off()
        finally:
            ctx.pacer.claim_ended(ask, got, seconds)
        return got > 0

    def _claim(self, repo: Any, queues: list[str], limit: int) -> list[Any]:
        """Claim on this claimer thread's own connection (autocommit: the
        claim commits at once), or in a transaction of the worker's control."""
        ctx = self.ctx
        params = {"queues": queues, "limit": limit, "worker": ctx.name, "lease": ctx.options.lease}
        if self._held is None:
            with ctx.control() as session:
                return repo.claimer.claim(session, params)  # type: ignore[no-any-return]
        return claim_on(repo, self._held.connection(), params)

    def _submit(self, repo: object, jobs: list[object]) -> None:
        """Queue claimed jobs for the slots: one call per job, but the jobs of
        ``group_commit`` tasks in groups, one call and one transaction each."""
        ctx = self.ctx
        grouped: list[Held] = []
        alone: list[Held] = []
        for held in ctx.books.hold_all(repo, jobs):
            task = ctx.tasks.get(held.job.task)
            (grouped if task is not None and task.group_commit else alone).append(held)
        self.slots.submit_each(self.executor.run, alone)
        start = 0
        for size in group_sizes(len(grouped), ctx.options.concurrency):
            group = grouped[start:start + size]
            start += size
            if size == 1:
                self.slots.submit(self.executor.run, group[0])
            else:
                self.slots.submit(self.groups.run, group, weight=size)

    # -- duties on held jobs ---------------------------------------------------

    def heartbeat(self) -> None:
        """Extend the leases of the held jobs; learn of lost leases and cancel requests."""
        heartbeat(self.ctx, self.cancel)

    def cancel_notified(self, job_id: int) -> None:
        held = self.ctx.books.by_id(job_id)
        if held is not None:
            self.cancel(held)

    def cancel(self, held: Held) -> None:
        """A cancel was asked for ``held``: tell the job; it ends cancelled when its handler returns."""
        request_cancel(self.ctx, held)

    def watch(self, now: float) -> None:
        """Time out held jobs past their deadline; give up on slots stuck past the grace;
        hand back again, once a poll interval, the jobs whose hand back failed."""
        if now >= self._next_hand_back:
            again = self.ctx.take_hand_backs()
            if again:
                self._next_hand_back = now + self.ctx.options.poll_interval
                hand_back(self.ctx, again)
        stall = self.ctx.options.stall_timeout
        next_due = float("inf")
        for held in self.ctx.books.held():
            if held.deadline is not None and now < held.deadline:
                next_due = min(next_due, held.deadline)
            elif held.deadline is not None and not held.finished:
                self._time_out(held)
            elif (stall is not None and held.connecting_since is not None
                  and now - held.connecting_since >= stall.total_seconds()):
                self._give_up_connecting(held)
        for held in list(self._overdue):
            if held.finished:
                self._overdue.remove(held)
            elif held.deadline is not None and now >= held.deadline + grace(held) and held.thread is not None:
                self._overdue.remove(held)
                if self.slots.abandon(held.thread):
                    log.error("worker %s: job %s (%s) is still running %g s past its deadline; its thread is "
                              "given up on and replaced (%s stuck so far)", self.ctx.name, held.job.id,
                              held.job.task, grace(held), self.slots.stuck)
        for held in self._overdue:
            if held.deadline is not None:
                next_due = min(next_due, held.deadline + grace(held))
        self._next_due = next_due
        check_stuck(self.ctx, self.slots)

    def _give_up_connecting(self, held: Held) -> None:
        """A job's session stalled in the pool's checkout (a pre-ping on a
        half-open path: before the job holds the connection, so the watchdog
        cannot see it): replace the thread and hand the job back, unstarted."""
        with held.lock:
            if held.connecting_since is None or held.gave_up or held.thread is None:
                return
            held.gave_up = True
            if not self.slots.abandon(held.thread, stuck=False):
                return
        log.error("worker %s: job %s's session has waited %.0f s for a connection; its thread is replaced and the "
                  "job handed back unstarted", self.ctx.name, held.job.id,
                  (self.ctx.options.stall_timeout or timedelta(0)).total_seconds())
        hand_back(self.ctx, [held, *held.followers])

    def _time_out(self, held: Held) -> None:
        ctx, job = self.ctx, held.job
        with held.lock:
            if held.finished:
                return
            held.timed_out = True
            ctx.books.release(job)  # no more heartbeats: the lease runs out even if all else fails
            if held.backend_pid is not None:
                try:
                    with ctx.control() as session:
                        session.execute(select(func.pg_cancel_backend(held.backend_pid)))
                except Exception:
                    log.exception("worker %s: cancelling the statement of job %s failed", ctx.name, job.id)
        self._overdue.append(held)
        if held.cancel_requested:
            self.executor.finish_cancelled(held)
            return
        record_timeout(ctx, held)

    # -- stopping ----------------------------------------------------------------

    def stop_claiming(self, until: float) -> None:
        """Wait for the claims in flight, then hand back the jobs not started."""
        self.claimers.wait_idle(max(0.0, until - time.monotonic()))
        unstarted = [h for args in self.slots.take_unstarted()
                     for h in (args[0] if isinstance(args[0], list) else [args[0]])]
        if unstarted:
            count = hand_back(self.ctx, unstarted)
            log.info("worker %s: handed back %s claimed job(s) not started: %s", self.ctx.name, count,
                     ", ".join(str(h.job.id) for h in unstarted))

    def describe_running(self) -> str:
        running = [h for h in self.ctx.books.held() if h.started is not None and not h.finished]
        return (f"{len(running)} job(s) still running, left to their lease: "
                + ", ".join(f"{h.job.id} ({h.job.task})" for h in running))

    def close(self, *, wait: bool) -> None:
        self.claimers.close(wait=wait)
        self.slots.close(wait=wait)
