"""Grouped commits: several short jobs in one transaction (lease mode).

A task registered with ``group_commit=True`` promises that its handler
takes the job's session and writes to the database only. The jobs of such
tasks that one claim brings are run by one slot in groups
(:func:`group_sizes`): one session, each handler in turn, one flush, one
fenced completion of all of them and one COMMIT. BEGIN, the completion's
round trip and the COMMIT's flush of the WAL are paid once per group
instead of once per job.

What a caller may rely on is what a job alone gets: its writes commit
exactly once, with its completion, or not at all. When anything goes wrong
in a group (a handler raises, the flush fails, a deadline passes or a cancel
is asked for while the group runs, a lease was lost, the COMMIT fails), the
whole transaction rolls back; the job to blame, when there is one, is
settled alone (its failure recorded, or its cancel, or its loss), and every
other job of the group runs again on its own, in a transaction of its own,
exactly as an ungrouped job runs. So a grouped handler may run twice, never
more, and ``job_started`` may be sent twice for its job; its writes still
commit once. A handler with effects outside the database must not be grouped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sqlalchemy.orm import Session

from .. import signals
from ..connections import backend_pid, is_fatal_to_connection
from ..inflight import ConnectionWatch
from ..results import result_to_store, store_results
from .books import Held
from .context import WorkerContext
from .failures import refuse_awaitable

log = logging.getLogger("sa_jobqueue.worker")

#: The most jobs one transaction of grouped commits holds.
GROUP_MOST = 50


def group_sizes(count: int, concurrency: int, most: int = GROUP_MOST) -> list[int]:
    """How to split ``count`` grouped jobs of one claim: into groups of at
    most ``most``, and into at least ``concurrency`` groups while there are
    jobs enough, so that no slot waits while one runs a large group."""
    if count <= 0:
        return []
    size = min(most, max(1, -(-count // max(1, concurrency))))
    sizes = [size] * (count // size)
    if count % size:
        sizes.append(count % size)
    return sizes


def is_grouped(tasks: Any, job: Any) -> bool:
    """Whether ``job``'s task is known and registered with ``group_commit``."""
    task = tasks.get(job.task)
    return task is not None and bool(task.group_commit)


def batch_parts(
    jobs: Sequence[Any], grouped: Callable[[Any], bool], most: int = GROUP_MOST
) -> list[tuple[bool, list[Any]]]:
    """Transaction mode: a batch's jobs in claim order, as the parts it runs,
    each ``(is_group, jobs)``: a run of consecutive ``grouped`` jobs (at most
    ``most``) is a group, run under one SAVEPOINT; any other job is a part of
    its own."""
    parts: list[tuple[bool, list[Any]]] = []
    for job in jobs:
        is_group = grouped(job)
        if is_group and parts and parts[-1][0] and len(parts[-1][1]) < most:
            parts[-1][1].append(job)
        else:
            parts.append((is_group, [job]))
    return parts


def count_lost(ctx: WorkerContext, group: Sequence[Held], done: set[int]) -> list[Held]:
    """Of a group whose grouped completion the fence refused in part, count (and log) the jobs
    lost, those not in ``done``; return the others, to run again alone."""
    rest = []
    for held in group:
        if held.job.id in done:
            rest.append(held)
        else:
            log.warning("worker %s: job %s was no longer owned at its grouped completion (lease expired); "
                        "the group rolled back and its other jobs run again alone", ctx.name, held.job.id)
            ctx.books.count("lost")
    return rest


class Executor(Protocol):
    """What groups need of :class:`~sa_jobqueue.worker.executor.JobExecutor`."""

    ctx: WorkerContext

    def run(self, held: Held) -> bool: ...
    def start(self, held: Held, task: object) -> None: ...
    def after_failure(self, held: Held, task: object, exc: BaseException) -> None: ...
    def finish_cancelled(self, held: Held) -> None: ...
    def hand_back_unstarted(self, held: list[Held], exc: Exception) -> None: ...


class GroupRunner:
    """Runs groups of held jobs of one table, each of a ``group_commit`` task; called from slot threads."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.ctx = executor.ctx

    def run(self, group: list[Held]) -> bool:
        """Run every job of ``group`` to its outcome; True (the slot found work)."""
        todo = [h for h in group if not h.cancel_requested]
        for held in group:
            if held.cancel_requested:  # asked for before it started: ends cancelled, alone
                self.executor.run(held)
        again = self._run(todo) if len(todo) > 1 else todo
        for held in again:
            with held.lock:
                held.finished = False  # its own run now: the watch times it out again
            self.executor.run(held)
        return True

    def _run(self, group: list[Held]) -> list[Held]:
        """Run ``group`` in one transaction; return the jobs to run again alone."""
        leader, ident = group[0], threading.get_ident()
        for held in group:
            held.thread = ident
        leader.followers = tuple(group[1:])
        leader.connecting_since = time.monotonic()  # the lease mode's watch gives up on a stalled checkout
        try:
            session, connection = self.ctx.job_sessions.open(leader.repo.table)
        except Exception as exc:
            with leader.lock:
                leader.connecting_since = None
                gave_up = leader.gave_up
            if not gave_up:
                self.executor.hand_back_unstarted(group, exc)
            return []
        with session:
            try:
                return self._in_session(group, session, connection)
            finally:
                for held in group:
                    with held.lock:  # before the connection serves another job: no cancel of its statement
                        held.finished = True

    def _in_session(self, group: list[Held], session: Session, connection: object) -> list[Held]:
        ctx, pid = self.ctx, backend_pid(connection)
        for held in group:
            held.backend_pid = pid
        with group[0].lock:  # decided once: the watch gave up on this checkout, or it did not
            group[0].connecting_since = None
            if group[0].gave_up:
                return []  # handed back, all of the group, while the checkout stalled; this thread was replaced
        watch = ctx.watch(connection)
        ctx.session_opened(1)
        try:
            return self._attempt(group, session, connection, watch)
        except BaseException as exc:  # the flush, the completion or the COMMIT: no handler to blame
            if is_fatal_to_connection(exc):
                connection.invalidate()  # type: ignore[attr-defined]  # never hand it to the next job
            session.rollback()
            log.info("worker %s: a group of %s jobs rolled back (%r); each runs again alone", ctx.name,
                     len(group), exc)
            return self._unsettled(group)
        finally:
            ctx.session_opened(-1)
            watch.release()

    def _attempt(self, group: list[Held], session: Session, connection: object, watch: ConnectionWatch) -> list[Held]:
        ctx, repo = self.ctx, group[0].repo
        started = time.monotonic()
        results: dict[int, str] = {}
        for held in group:
            task = ctx.tasks.get(held.job.task)
            assert task is not None  # the claim grouped the job for its task's group_commit
            self.executor.start(held, task)
            try:
                with self.ctx.running_job(held.job):
                    stored = result_to_store(task, repo, refuse_awaitable(task.run(held.job, session)))
                if stored is not None:
                    results[held.job.id] = stored
            except BaseException as exc:  # SystemExit from a handler is a failure too
                if is_fatal_to_connection(exc):
                    connection.invalidate()  # type: ignore[attr-defined]
                session.rollback()
                return self._failed(group, held, task, exc)
            with held.lock:
                if not held.timed_out:
                    # Its deadline bounds its handler: the later handlers of
                    # the group are not its own time.
                    held.deadline = None
        session.flush()
        if any(h.timed_out or h.cancel_requested for h in group):
            session.rollback()
            return self._unsettled(group)
        for held in group:
            ctx.books.release(held.job)
        done = repo.complete_many(session, [h.job for h in group])
        if len(done) < len(group):
            session.rollback()
            return self._lost(group, done)
        store_results(session, repo.table, results)
        with watch.in_flight():  # a COMMIT stalled on the network is the watchdog's too
            session.commit()
        ctx.books.count("completed", len(group))
        each = (time.monotonic() - started) / len(group)
        for held in group:
            ctx.pacer.job_ran(each)
            ctx.books.tally(held.job, "completed")
            signals.send(signals.job_succeeded, ctx.sender, job=held.job,
                         duration=time.monotonic() - (held.started or started))
        return []

    def _failed(self, group: list[Held], culprit: Held, task: object, exc: BaseException) -> list[Held]:
        """A handler of the group raised: its failure is recorded alone; the others run again."""
        if any(h.timed_out for h in group):
            # A deadline cancels the group's statement on the server, which may
            # have hit another job's handler: blame nobody, run each again alone.
            return self._unsettled(group)
        rest = [h for h in group if h is not culprit]
        with self.ctx.running_job(culprit.job):
            self.executor.after_failure(culprit, task, exc)
        log.info("worker %s: job %s failed in a group; the group's other %s job(s) run again alone",
                 self.ctx.name, culprit.job.id, len(rest))
        return self._unsettled(rest)

    def _lost(self, group: list[Held], done: set[int]) -> list[Held]:
        """The fence refused some completions (their leases had expired): those are lost; the others run again."""
        return self._unsettled(count_lost(self.ctx, group, done))

    def _unsettled(self, held_jobs: list[Held]) -> list[Held]:
        """Of jobs whose group rolled back, those to run again alone: not the
        ones timed out (the watch recorded their failure) nor those whose
        cancel was asked for (they end cancelled here)."""
        again = []
        for held in held_jobs:
            with held.lock:
                settled = held.timed_out
                if not settled:
                    held.started = held.deadline = None  # its deadline starts again with its next run
            if settled:
                continue
            if held.cancel_requested:
                self.executor.finish_cancelled(held)
                continue
            self.ctx.books.keep(held)  # released for the group's completion: its lease extended again
            again.append(held)
        return again
