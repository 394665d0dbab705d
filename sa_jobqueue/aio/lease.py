"""The asyncio worker's lease mode: claims, the watch over held jobs, stopping.

As in the thread worker (:mod:`sa_jobqueue.worker.lease`), claims commit
at once on the worker's own autocommit connections, up to CLAIMERS in
flight, each claim on a connection kept from one claim to the next (a
checkout and a session per claim cost a notified job about a fifth of its
wait); each claimed job is held (its lease extended by the heartbeat)
and runs as a task of its own (:class:`~sa_jobqueue.aio.slots.JobSlots`), or,
for the ``async def`` handlers of ``group_commit`` tasks, in groups, a task
and a transaction each (:mod:`~sa_jobqueue.aio.group`).
The claim, heartbeat and hand-back statements are the thread worker's own
steps, run through :func:`~sa_jobqueue.aio.bridge.in_greenlet`.

What happens to a held job from outside its task:

* its deadline passes: the lease is no longer extended, the coroutine is
  cancelled, its statement on the server too (``pg_cancel_backend``, for a
  sync handler in a thread, whose Python code cannot be interrupted), and
  the failure is recorded ("timed out after N s");
* a cancel is asked for from another process (at the heartbeat, or at once
  through NOTIFY): the job is told and its coroutine cancelled; it ends
  ``cancelled``;
* a stop: the jobs claimed but not started are handed back at once,
  fenced, their attempt not spent; at the ``shutdown_timeout`` the
  coroutines still running are cancelled, each recorded as an interrupted
  attempt (:mod:`~sa_jobqueue.aio.executor`); a group runs no further
  handler once the worker stops, and hands back the jobs that did not run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..worker.books import Held
from ..worker.context import WorkerContext
from ..worker.deadlines import record_timeout
from ..worker.executor import hand_back
from ..worker.group import group_sizes
from ..worker.heartbeat import heartbeat, request_cancel
from ..worker.held import KeptConnections
from ..worker.lease import claim_on
from .bridge import in_greenlet
from .executor import AsyncJobExecutor, cancel_backend
from .group import AsyncGroupRunner, runs_grouped
from .slots import JobSlots

log = logging.getLogger("sa_jobqueue.worker")

__all__ = ["AsyncLeaseMode"]


class AsyncLeaseMode:
    """The lease-mode strategy of the asyncio worker's loop."""

    def __init__(self, ctx: WorkerContext, executor: AsyncJobExecutor, wake: Callable[[], None],
                 sessions: int | None = None, stopping: asyncio.Event | None = None) -> None:
        """``sessions``: how many jobs may hold a session at once (``max_sessions``), and so run a
        group; ``stopping``: the worker's, set when a stop is asked for."""
        self.ctx = ctx
        self.executor = executor
        self.wake = wake
        self.stopping = stopping or asyncio.Event()
        self.groups = AsyncGroupRunner(executor, self.stopping)
        self.slots = JobSlots(ctx.options.concurrency, executor.run, on_done=self._slot_done,
                              run_group=self.groups.run)
        executor.job_sessions.jobs_wait = self.slots.jobs_wait  # a job's connection is kept for the next
        # A claim's grouped jobs are spread over the groups that can run at
        # once: one per slot, as in the thread worker, but each holds a session.
        self._spread = min(ctx.options.concurrency, sessions or ctx.options.concurrency)
        self.claiming: set[asyncio.Task[bool]] = set()
        engine = ctx.control.engine  # the worker's own: its claims' connections are kept between claims
        self._claim_connections = KeptConnections(engine) if engine is not None else None
        self._hits = self._misses = 0
        self._side_tasks: set[asyncio.Task[Any]] = set()  # time-outs and hand backs run by the watch
        self._next_connect_check = 0.0  # when the watch next looks for sessions stalled in their checkout

    # -- the loop's step -----------------------------------------------------

    def step(self, now: float, *, listening: bool, until_empty: bool) -> bool:
        """Take results, send the claims the pacer asks for; True when drained (until_empty)."""
        pacer = self.ctx.pacer
        hits, misses, self._hits, self._misses = self._hits, self._misses, 0, 0
        claiming = len(self.claiming)
        ran, held = self.slots.take_results()
        pacer.results(now, hits=hits, misses=misses, claiming=claiming, ran=ran, listening=listening)
        for ask in pacer.claims(now, held=held, claiming=claiming):
            pacer.claim_sent(ask)
            claim = asyncio.get_running_loop().create_task(self._claim_into(ask), name="sa_jobqueue-claim")
            self.claiming.add(claim)
        busy = bool(held or self.claiming or len(self.ctx.completer) or self._side_tasks)
        return until_empty and pacer.drained(busy=busy)

    @property
    def busy(self) -> bool:
        """Whether a job's task runs."""
        return bool(self.slots.running)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no job to run; True when none runs."""
        return await self.slots.wait_idle(timeout)

    def _slot_done(self) -> None:
        self.wake()

    async def _claim_into(self, ask: int) -> bool:
        ctx, got, took = self.ctx, 0, 0.0
        seconds: float | None = None  # the claims' time, for the pacer's sense of a short job
        try:
            for repo in ctx.rotation():
                if got >= ask:
                    break
                start = time.monotonic()
                jobs = await in_greenlet(self._claim, repo, ask - got)
                took += time.monotonic() - start
                got += len(jobs)  # committed: ours now
                self._submit(repo, jobs)
            seconds = took
        except Exception:
            log.exception("worker %s: claim failed; retrying after a pause", ctx.name)
            ctx.back_off()
        finally:
            ctx.pacer.claim_ended(ask, got, seconds)
            if got:
                self._hits += 1
            else:
                self._misses += 1
            current = asyncio.current_task()
            if current is not None:
                self.claiming.discard(current)
            self.wake()
        return got > 0

    def _submit(self, repo: Any, jobs: list[Any]) -> None:
        """Queue claimed jobs for the slots: one task per job, but the jobs of
        ``group_commit`` tasks with an ``async def`` handler in groups, one task
        and one transaction each."""
        ctx, grouped = self.ctx, []
        for job in jobs:
            held = ctx.books.hold(repo, job)
            if runs_grouped(ctx.tasks, job):
                grouped.append(held)
            else:
                self.slots.submit(held)
        start = 0
        for size in group_sizes(len(grouped), self._spread):
            group = grouped[start:start + size]
            start += size
            self.slots.submit(group if size > 1 else group[0])

    def _claim(self, repo: Any, limit: int) -> list[Any]:
        """Claim on a kept connection of the worker's own engine (autocommit:
        the claim commits at once), or in a transaction of the worker's control."""
        ctx = self.ctx
        queues = ctx.queues_for(repo)
        if not queues:  # every queue of this table is paused
            return []
        params = {"queues": queues, "limit": limit, "worker": ctx.name, "lease": ctx.options.lease}
        kept = self._claim_connections
        if kept is None:
            with ctx.control() as session:
                return repo.claimer.claim(session, params)  # type: ignore[no-any-return]
        connection = kept.take()
        try:
            return claim_on(repo, connection, params)
        finally:
            kept.give(connection)

    async def release_connections(self) -> None:
        """The worker's end: the connections kept for claims and for jobs go back to their pools."""
        if self._claim_connections is not None:
            await in_greenlet(self._claim_connections.release)
        await self.executor.job_sessions.release_idle()

    # -- duties on held jobs ---------------------------------------------------

    async def heartbeat(self) -> bool:
        await in_greenlet(heartbeat, self.ctx, self.cancel)
        return False

    def cancel_notified(self, job_id: int) -> None:
        held = self.ctx.books.by_id(job_id)
        if held is not None:
            self.cancel(held)

    def cancel(self, held: Held) -> None:
        """A cancel was asked for ``held``: tell the job and cancel its coroutine."""
        if request_cancel(self.ctx, held) and held.task is not None:
            held.task.cancel()

    def watch(self, now: float) -> float:
        """Time out the held jobs past their deadline; return the next deadline (monotonic, or inf)."""
        again = self.ctx.take_hand_backs()
        if again:
            self._spawn(self._hand_back(again))
        next_due = float("inf")
        stall = self.ctx.options.stall_timeout
        if stall is not None and now >= self._next_connect_check:
            # Once a second, not at every wake: it scans every running job, and
            # the timeout it enforces is counted in seconds.
            self._next_connect_check = now + 1.0
            self._give_up_connecting(now, stall.total_seconds())
        for held in self.ctx.books.held():
            if held.deadline is None or held.finished or held.timed_out:
                continue
            if now < held.deadline:
                next_due = min(next_due, held.deadline)
            else:
                held.timed_out = True  # here, not in the task: the next watch must not time it out again
                self._spawn(self._time_out(held))
        return next_due

    def _give_up_connecting(self, now: float, stall: float) -> None:
        """A job's session stalled in the pool's checkout (a pre-ping on a
        half-open path, before the job holds the connection, so the watchdog
        cannot see it): cancel its wait; the job hands itself back, unstarted."""
        for task, held in self.slots.members():
            if (held.started is None and not held.gave_up and held.connecting_since is not None
                    and now - held.connecting_since >= stall):
                held.gave_up = True
                log.error("worker %s: job %s's session has waited %.0f s for a connection; the job is handed back "
                          "unstarted", self.ctx.name, held.job.id, stall)
                task.cancel()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _hand_back(self, held: list[Held]) -> None:
        await in_greenlet(hand_back, self.ctx, held)

    async def _time_out(self, held: Held) -> None:
        ctx, job = self.ctx, held.job
        ctx.books.release(job)  # no more heartbeats: the lease runs out even if all else fails
        if held.task is not None:
            held.task.cancel()  # the executor cancels its statement on the server too
        elif held.backend_pid is not None:
            # A sync handler in a thread: its statement on the server is all that can be cancelled.
            await cancel_backend(ctx, held.backend_pid)
        if held.cancel_requested:
            await in_greenlet(self.executor.steps.finish_cancelled, held)
            return
        await in_greenlet(record_timeout, ctx, held)

    # -- stopping ----------------------------------------------------------------

    async def stop_claiming(self, until: float) -> None:
        """Wait for the claims in flight, then hand back at once the jobs not started
        (those in the ready queue, and those waiting for a session); running
        groups start no further handler."""
        self.stopping.set()
        loop = asyncio.get_running_loop()
        if self.claiming:
            await asyncio.wait(set(self.claiming), timeout=max(0.0, until - loop.time()))
        unstarted = self.slots.take_unstarted()
        for task, held in self.slots.members():
            if held.started is None and held.connecting_since is not None:
                task.cancel()  # waiting for a session: it hands itself back
        if unstarted:
            count = await in_greenlet(hand_back, self.ctx, unstarted)
            log.info("worker %s: handed back %s claimed job(s) not started: %s", self.ctx.name, count,
                     ", ".join(str(h.job.id) for h in unstarted))

    def interrupt(self) -> int:
        """The shutdown timeout passed: cancel the coroutines still running
        (a group's once, all its jobs marked); return how many jobs they run."""
        self.stopping.set()
        tasks: set[asyncio.Task[Any]] = set()
        count = 0
        for _, held in self.slots.members():
            if held.task is not None and not held.finished:
                held.interrupted = True
                tasks.add(held.task)
                count += 1
        for task in tasks:
            task.cancel()
        return count

    async def settle(self, timeout: float) -> None:
        """The run ends with work in flight (a stop at once, an error, the run's
        own task cancelled, or jobs still running past the shutdown timeout):
        cancel the jobs' tasks and the claims in flight, and wait up to
        ``timeout`` for each. Nothing more is recorded: the jobs are left to
        their lease. A claim is waited for so that it never outlives the run:
        cancelled, it raises at its await even when its answer had come (a
        claim the server committed then leaves its jobs to their lease), and
        ends at once, its connection discarded."""
        for task in list(self.slots.running):
            task.cancel()
        for claim in list(self.claiming):
            claim.cancel()
        await self.slots.wait_idle(timeout)
        if self.claiming:
            await asyncio.wait(set(self.claiming), timeout=timeout)

    def describe_running(self) -> str:
        running = [h for h in self.ctx.books.held() if h.started is not None and not h.finished]
        return (f"{len(running)} job(s) still running, left to their lease: "
                + ", ".join(f"{h.job.id} ({h.job.task})" for h in running))
