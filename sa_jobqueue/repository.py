"""JobRepository: the queue verbs, run on a session the caller gives.

::

    emails = JobRepository(EmailJob)
    with Session(engine) as session, session.begin():
        session.add(User(name="ada"))
        emails.enqueue(session, "send_welcome", {"user_id": 42}, queue="signup")

No verb commits, rolls back or opens a transaction: each runs its statements
on the caller's session, so an enqueue commits (or vanishes) with the
caller's own writes. Verbs after a claim (``complete``, ``fail``,
``heartbeat``, ``extend_leases``, ``hand_back``, ``mark_cancelled``) are
fenced on the claim's ``lock_token``: they change nothing of a job the caller
no longer owns, and the single-job ones raise :class:`JobLostError` then.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Generic, TypeVar

from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import NoInspectionAvailable
from sqlalchemy.orm import Session

from . import bulk, statements
from .errors import InvalidArgumentError, JobLostError, JobTableError
from .listener import channel_name
from .mixin import (
    CANCELLED,
    DEAD,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    STATUSES,
    JobMixin,
    claim_index_name,
    dedupe_index_name,
    lease_index_name,
)
from .retry import DEFAULT_RETRY_POLICY, RetryPolicy
from .snapshot import Snapshots, json_loads
from .spec import (
    JobSpec,
    check_aware,
    check_bool,
    check_claimed,
    check_claimed_many,
    check_delay,
    check_job_id,
    check_lease,
    check_older_than,
    check_policy,
    check_queues,
    check_session,
    check_specs,
    check_statuses,
    check_task_limits,
    check_worker_name,
    clean_error,
    positive_int,
    to_row,
)
from .statements import cancel_channel_name

M = TypeVar("M", bound=JobMixin)

log = logging.getLogger("sa_jobqueue.repository")

_NO_SYNC = {"synchronize_session": False}
# session.info key: (transaction, {(channel, queue)}) already notified in it.
_NOTIFIED = "sa_jobqueue.notified"
DEFAULT_LEASE = timedelta(seconds=60)


def default_worker_name() -> str:
    """``host:pid:random``: unique per process, readable in ``locked_by``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class ReapResult:
    """What one reap did: jobs sent back to pending, jobs sent to dead, and
    jobs cancelled (a cancel was requested while they ran)."""

    requeued: int
    dead: int
    cancelled: int = 0


@dataclass(frozen=True)
class LeaseReport:
    """What one :meth:`JobRepository.extend_leases` found: the ids of the jobs
    still owned (their leases extended), and those of them whose cancel was
    requested (a subset of ``owned``)."""

    owned: set[int]
    cancel_requested: set[int]


@dataclass(frozen=True)
class QueueStats:
    """Jobs of one queue in one status. ``oldest_runnable_age`` is set for
    ``pending`` rows: how long the oldest runnable job has been waiting."""

    queue: str
    status: str
    count: int
    oldest_runnable_age: timedelta | None


def _job_table_or_raise(model: Any) -> Any:
    if not isinstance(model, type) or not issubclass(model, JobMixin):
        raise JobTableError(
            f"model: {model!r} is not a JobMixin model; declare "
            "`class MyJob(JobMixin, Base): __tablename__ = ...` and pass the class"
        )
    try:
        table = sa_inspect(model).local_table
    except NoInspectionAvailable:
        raise JobTableError(
            f"model: {model.__name__} uses JobMixin but is not mapped; "
            "it needs a declarative Base and a __tablename__"
        ) from None
    names = {index.name for index in table.indexes}
    wanted = [claim_index_name(table.name), lease_index_name(table.name), dedupe_index_name(table.name)]
    missing = [name for name in wanted if name not in names]
    if missing:
        raise JobTableError(
            f"model: {model.__name__} (table {table.name!r}) lacks the job indexes "
            f"{missing}; its __table_args__ replaced JobMixin's. Keep them with "
            "`@declared_attr.directive def __table_args__(cls): "
            "return (*job_table_args(cls.__tablename__), ...)`"
        )
    return table


class JobRepository(Generic[M]):
    """The queue verbs for one job model (one table, any number of queues)."""

    def __init__(self, model: type[M], *, notify: bool = True) -> None:
        """Raise :class:`JobTableError` unless ``model`` is a mapped JobMixin
        model that still has its claim, lease and dedupe indexes.

        With ``notify`` (the default), enqueueing runnable jobs sends one
        NOTIFY per transaction and queue on the table's channel, which wakes
        listening workers at commit.
        """
        table = _job_table_or_raise(model)
        self.model = model
        self.table = table
        self.notify = notify
        self.channel = channel_name(table.name)
        self.cancel_channel = cancel_channel_name(table.name)
        self.keep_done: bool = bool(getattr(model, "__keep_done__", False))
        job_columns = {name for name in JobMixin.__annotations__ if not name.startswith("__")}
        self._user_columns = frozenset(c.key for c in table.columns if c.key not in job_columns)
        # Statements are values: built once, reused with new parameters, so the
        # hot path skips construction and hits SQLAlchemy's compiled cache.
        self._snapshots: Snapshots[M] = Snapshots(model, table)
        returned = self._snapshots.columns
        self._claim = statements.claim(model).returning(*self._snapshots.text_columns)
        self._complete = statements.complete(model, keep_done=self.keep_done)
        self._fail = statements.fail(model)
        self._heartbeat = statements.heartbeat(model)
        self._hand_back = statements.hand_back(model)
        self._mark_cancelled = statements.mark_cancelled(model)
        self._bury = statements.bury(model)
        self._reap = statements.reap(model)
        self._cancel = statements.cancel(model)
        self._retry = statements.retry(model)
        self._insert = statements.insert_jobs(model, dedupe=False).returning(
            *returned, sort_by_parameter_order=True
        )
        self._insert_dedupe = statements.insert_jobs(model, dedupe=True).returning(*returned)
        self._insert_one = statements.insert_jobs(model, dedupe=False).returning(*returned)
        self._insert_one_notify = statements.insert_jobs(model, dedupe=False).returning(
            *returned, statements.notify_column(model)
        )
        self._complete_many = statements.complete_many(model, keep_done=self.keep_done)
        self._notify = statements.notify()
        self._sequence: str | None = None  # the id sequence, read at the first COPY

    def __repr__(self) -> str:
        return f"JobRepository({self.model.__name__})"

    # -- enqueue ---------------------------------------------------------

    def enqueue(
        self,
        session: Session,
        task: str,
        payload: Any = None,
        *,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        run_at: datetime | None = None,
        delay: timedelta | float | None = None,
        max_attempts: int | None = None,
        dedupe_key: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> M:
        """Insert one job in the caller's transaction and return it (a
        detached snapshot of the row as inserted, see :mod:`sa_jobqueue.snapshot`).

        ``max_attempts``: the job's own limit, which wins over its task's;
        None (the default) leaves the row's NULL, so that the task's
        ``max_attempts`` applies, else 20 (:data:`~sa_jobqueue.mixin.DEFAULT_MAX_ATTEMPTS`).

        With ``dedupe_key``, while a live job of the same queue holds the key,
        that job is returned and nothing is inserted.
        """
        check_session(session)
        spec = JobSpec(
            task=task, payload=payload, queue=queue, priority=priority, run_at=run_at,
            delay=delay, max_attempts=max_attempts, dedupe_key=dedupe_key, extra=extra or {},
        )
        if dedupe_key is not None:
            return self.enqueue_many(session, [spec])[0]
        # One row: a plain INSERT … RETURNING, with the NOTIFY folded into the
        # same statement when this transaction has not notified the queue yet.
        row = to_row(spec, self._user_columns)
        notify = self.notify and _runnable_now(row) and row["queue"] not in self._notified(session)
        if not notify:
            return self._snapshots.one(session.execute(self._insert_one, row).one())
        inserted = session.execute(self._insert_one_notify, row | {"sajq_channel": self.channel}).one()
        self._mark_notified(session, [row["queue"]])
        return self._snapshots.one(inserted)

    def enqueue_many(self, session: Session, jobs: Iterable[JobSpec]) -> list[M]:
        """Insert many jobs, one INSERT per group of like rows (batched by
        SQLAlchemy's insertmanyvalues), and return them (detached snapshots)
        in input order.

        Every spec is checked before anything is sent. Rows with a dedupe key
        that a live job holds (or that an earlier row of this call holds)
        come back as that job. Rows with a key are written sorted by
        ``(queue, dedupe_key)``, so concurrent calls with overlapping keys
        wait for each other in line instead of deadlocking.
        """
        check_session(session)
        rows = [to_row(spec, self._user_columns) for spec in check_specs(jobs)]
        result: list[M | None] = [None] * len(rows)
        # Keyed rows in one global order (no deadlock between producers), see bulk.write_order.
        for dedupe, indexes in bulk.write_order(rows):
            params = [rows[i] for i in indexes]
            if not dedupe:
                copied = self._copy(session, params)
                if copied is not None:
                    for i, job in zip(indexes, copied, strict=True):
                        result[i] = job
                    continue
                inserted_rows = session.execute(self._insert, params).all()
                for i, job in zip(indexes, self._snapshots.all(inserted_rows), strict=True):
                    result[i] = job
                continue
            inserted = self._snapshots.all(session.execute(self._insert_dedupe, params).all())
            by_key = {(job.queue, job.dedupe_key): job for job in inserted}
            wanted = {(row["queue"], row["dedupe_key"]) for row in params} - set(by_key)
            if wanted:
                existing = self._snapshots.all(session.execute(
                    statements.live_jobs_by_dedupe_key(
                        self.model, self._snapshots.columns, [q for q, _ in wanted], [k for _, k in wanted]
                    )
                ).all())
                by_key.update({(job.queue, job.dedupe_key): job for job in existing})
            for i in indexes:
                found = by_key.get((rows[i]["queue"], rows[i]["dedupe_key"]))
                if found is None:
                    # The live holder finished between our INSERT and SELECT;
                    # the key is free again, so this row goes in after all.
                    found = self.enqueue_many(session, [_respec(rows[i])])[0]
                    by_key[(found.queue, found.dedupe_key)] = found
                result[i] = found
        if self.notify:
            self._notify_once(session, rows)
        return [job for job in result if job is not None]

    def _copy(self, session: Session, rows: list[dict[str, Any]]) -> list[M] | None:
        """COPY plain rows when COPY can stand in for the INSERT (see :mod:`sa_jobqueue.bulk`)."""
        if len(rows) < bulk.COPY_THRESHOLD or self._user_columns:
            return None
        conn = bulk.driver_connection(session)
        if conn is None:
            return None
        if self._sequence is None:
            self._sequence = bulk.sequence_of(session, self.table)
        stored = bulk.copy_rows(session, conn, self.table, self._sequence, rows)
        return [self._snapshots.of(values) for values in stored]

    def _notify_once(self, session: Session, rows: list[dict[str, Any]]) -> None:
        """NOTIFY the queues of runnable rows not yet notified in this transaction.

        Future-scheduled jobs send nothing: polling picks them up on time.
        """
        self._notify_queues(session, {row["queue"] for row in rows if _runnable_now(row)})

    def _notify_queues(self, session: Session, queues: set[str]) -> None:
        """NOTIFY the ``queues`` not yet notified in this transaction, in one statement."""
        fresh = sorted(queues - self._notified(session))
        if fresh:
            session.execute(self._notify, {"channel": self.channel, "queues": fresh})
            self._mark_notified(session, fresh)

    def _notified(self, session: Session) -> set[str]:
        """The queues of this table already notified in the session's transaction."""
        seen: tuple[object, set[tuple[str, str]]] | None = session.info.get(_NOTIFIED)
        if seen is None or seen[0] is not session.get_transaction():
            return set()
        return {queue for channel, queue in seen[1] if channel == self.channel}

    def _mark_notified(self, session: Session, queues: Iterable[str]) -> None:
        transaction = session.get_transaction()
        seen: tuple[object, set[tuple[str, str]]] | None = session.info.get(_NOTIFIED)
        if seen is None or seen[0] is not transaction:
            seen = (transaction, set())
            session.info[_NOTIFIED] = seen
        seen[1].update((self.channel, queue) for queue in queues)

    # -- claim and the fenced verbs --------------------------------------

    def claim(
        self,
        session: Session,
        *,
        queues: str | Sequence[str] = DEFAULT_QUEUE,
        limit: int = 1,
        worker: str | None = None,
        lease: timedelta = DEFAULT_LEASE,
    ) -> list[M]:
        """Claim up to ``limit`` runnable jobs from ``queues`` in one statement.

        The jobs come back ``running``, with ``attempts`` counted, owned by
        ``worker`` under a fresh ``lock_token`` until ``lease`` expires, in
        claim order (priority, then run_at, then id). Jobs scheduled in the
        future are not claimable. Fewer than ``limit`` rows does not mean the
        queue is empty (another claimer may hold rows); an empty list does.
        The jobs are detached snapshots (:mod:`sa_jobqueue.snapshot`).

        A claimed job whose payload the client cannot decode (such as JSON
        nested deeper than Python's recursion limit, written by SQL) is not
        returned: it goes to ``dead`` at once, in the same session, with
        ``last_error`` ``payload cannot be decoded: <error>``; the other jobs
        of the claim are returned as usual, and when there are none the claim
        is made again, so an empty list still means an empty queue.
        """
        check_session(session)
        limit = positive_int("limit", limit)
        lease = check_lease("lease", lease)
        worker = check_worker_name("worker", worker)
        params = {
            "queues": check_queues(queues), "limit": limit,
            "worker": worker or default_worker_name(), "lease": lease,
        }
        loads = json_loads(session.get_bind(self.model).dialect)
        while True:
            jobs, failed = self._snapshots.decode(session.execute(self._claim, params).all(), loads)
            if not failed:
                break
            self._bury_undecodable(session, failed)  # each round takes rows off the queue for good
            if jobs:
                break
        jobs.sort(key=lambda job: (job.priority, job.run_at, job.id))
        return jobs

    def _bury_undecodable(self, session: Session, failed: list[tuple[M, str]]) -> None:
        """Send claimed jobs whose payload cannot be decoded to dead, in one fenced statement."""
        errors = [clean_error(f"payload cannot be decoded: {error}") for _, error in failed]
        params = {"ids": [j.id for j, _ in failed], "tokens": [j.lock_token for j, _ in failed], "errors": errors}
        session.execute(self._bury, params, execution_options=_NO_SYNC)
        for (job, _), error in zip(failed, errors, strict=True):
            log.warning("%s %s (%s) sent to dead: %s", self.model.__name__, job.id, job.task, error[:500])

    def complete(self, session: Session, job: M) -> None:
        """Finish a claimed job: delete it, or mark it ``done`` when the model
        sets ``__keep_done__``. Raise :class:`JobLostError` if not owned."""
        check_session(session)
        check_claimed("job", job, self.model)
        params = {"job_id": job.id, "token": job.lock_token}
        if session.execute(self._complete, params, execution_options=_NO_SYNC).first() is None:
            raise JobLostError(job.id, "complete")

    def complete_many(self, session: Session, jobs: Sequence[M]) -> set[int]:
        """Finish many claimed jobs in one fenced statement; return the ids
        finished. A job missing from the result was no longer owned."""
        check_session(session)
        jobs = check_claimed_many("jobs", jobs, self.model)
        if not jobs:
            return set()
        params = {"ids": [j.id for j in jobs], "tokens": [j.lock_token for j in jobs]}
        return set(session.scalars(self._complete_many, params, execution_options=_NO_SYNC).all())

    def fail(
        self,
        session: Session,
        job: M,
        error: str,
        *,
        policy: RetryPolicy = DEFAULT_RETRY_POLICY,
        delay: timedelta | None = None,
        at: datetime | None = None,
        max_attempts: int | None = None,
        discard: bool = False,
    ) -> str:
        """Record a failed attempt of a claimed job and return its new status.

        The job goes back to ``pending`` after a backoff (``policy``'s delay
        for this attempt, or ``delay``, or at ``at``), or to ``dead`` when
        ``discard`` is set or its attempts reached its limit, or to
        ``cancelled`` (either way) when its cancel was requested while it ran.
        The limit is the one given at enqueue, else ``max_attempts`` (the
        task's own limit, as a worker passes it), else 20. ``error`` is kept
        in ``last_error``. Fenced.
        """
        check_session(session)
        check_claimed("job", job, self.model)
        policy = check_policy(policy)
        discard = check_bool("discard", discard)
        if max_attempts is not None:
            positive_int("max_attempts", max_attempts)
        at = check_aware("at", at)
        wait = check_delay("delay", delay) if delay is not None else policy.delay(job.attempts)
        params = {
            "job_id": job.id, "token": job.lock_token, "error": clean_error(error), "delay": wait, "at": at,
            "task_limit": max_attempts, "discard": discard,
        }
        row = session.execute(self._fail, params, execution_options=_NO_SYNC).first()
        if row is None:
            raise JobLostError(job.id, "fail")
        return str(row.status)

    def heartbeat(self, session: Session, jobs: Sequence[M], *, lease: timedelta = DEFAULT_LEASE) -> set[int]:
        """Extend the lease of claimed jobs; return the ids still owned.

        A job missing from the result was reaped: its worker should stop
        and must not expect its completion to be accepted.
        """
        return self.extend_leases(session, jobs, lease=lease).owned

    def extend_leases(self, session: Session, jobs: Sequence[M], *, lease: timedelta) -> LeaseReport:
        """Extend the lease of claimed jobs, as :meth:`heartbeat` does, in one
        fenced statement; report the ids still owned and, among them, those
        whose cancel was requested (:meth:`cancel`): their worker should stop
        them and end them with :meth:`mark_cancelled`."""
        check_session(session)
        jobs = check_claimed_many("jobs", jobs, self.model)
        lease = check_lease("lease", lease)
        if not jobs:
            return LeaseReport(owned=set(), cancel_requested=set())
        params = {"ids": [j.id for j in jobs], "tokens": [j.lock_token for j in jobs], "lease": lease}
        rows = session.execute(self._heartbeat, params, execution_options=_NO_SYNC).all()
        return LeaseReport(owned={r.id for r in rows}, cancel_requested={r.id for r in rows if r.cancel_requested})

    def hand_back(self, session: Session, jobs: Sequence[M]) -> set[int]:
        """Give claimed jobs that have not started back to the queue, in one
        fenced statement; return the ids given back (a job missing was no
        longer owned).

        Each job is ``pending`` again, unowned, runnable where it was in the
        queue (``run_at`` and ``last_error`` kept), with the claim's attempt
        taken back (``attempts - 1``): the run never started. A job whose
        cancel was requested meanwhile is ``cancelled`` instead (and in the
        result too). With ``notify``, the table's channel is notified once
        per queue of the jobs made pending, so that idle workers claim them.
        """
        check_session(session)
        jobs = check_claimed_many("jobs", jobs, self.model)
        if not jobs:
            return set()
        params = {"ids": [j.id for j in jobs], "tokens": [j.lock_token for j in jobs]}
        rows = session.execute(self._hand_back, params, execution_options=_NO_SYNC).all()
        if self.notify:
            self._notify_queues(session, {r.queue for r in rows if r.status != CANCELLED})
        return {r.id for r in rows}

    def mark_cancelled(self, session: Session, job: M, reason: str = "cancelled while running") -> None:
        """End a claimed job as ``cancelled`` (``finished_at`` set, no longer
        owned, ``reason`` kept in ``last_error`` as :meth:`fail` keeps its
        error). Raise :class:`JobLostError` if not owned. Fenced."""
        check_session(session)
        check_claimed("job", job, self.model)
        if not isinstance(reason, str):
            raise InvalidArgumentError("reason", f"must be a str, got {type(reason).__name__}")
        params = {"job_id": job.id, "token": job.lock_token, "error": clean_error(reason)}
        if session.execute(self._mark_cancelled, params, execution_options=_NO_SYNC).first() is None:
            raise JobLostError(job.id, "mark cancelled")

    # -- housekeeping ----------------------------------------------------

    def reap(
        self, session: Session, *, limit: int = 1000, task_max_attempts: Mapping[str, int] | None = None
    ) -> ReapResult:
        """Send running jobs whose lease expired back to pending, or to dead
        when their attempts are exhausted, or to cancelled when their cancel
        was requested. Safe to run from many workers.

        ``task_max_attempts`` (task name to limit) is the limit of the jobs
        of those tasks enqueued without one, as ``fail``'s ``max_attempts``
        is; a limit given at enqueue wins, and 20 applies when neither is.
        """
        check_session(session)
        limits = check_task_limits(task_max_attempts)
        params = {"limit": positive_int("limit", limit), "task_limits": limits}
        rows = session.execute(self._reap, params, execution_options=_NO_SYNC).all()
        dead = sum(1 for row in rows if row.status == DEAD)
        cancelled = sum(1 for row in rows if row.status == CANCELLED)
        return ReapResult(requeued=len(rows) - dead - cancelled, dead=dead, cancelled=cancelled)

    def cancel(self, session: Session, job_id: int) -> bool:
        """Cancel a job; return False, changing nothing, unless it is pending or running.

        A pending job is ``cancelled`` at once. A running job stays running:
        the request is recorded (``cancel_requested_at``) and notified on
        :attr:`cancel_channel` (payload: the job id) when the caller commits.
        Its worker learns of it then, or at its next heartbeat
        (:meth:`extend_leases`), and ends it cancelled; if the job leaves
        running first, a completion still completes it, while a failure, a
        hand-back or an expired lease ends it ``cancelled``.
        """
        check_session(session)
        job_id = check_job_id(job_id)
        params = {"job_id": job_id, "cancel_channel": self.cancel_channel}
        return session.execute(self._cancel, params, execution_options=_NO_SYNC).first() is not None

    def retry(self, session: Session, job_id: int) -> bool:
        """Send a dead or cancelled job back to pending now.

        Return False if the job is neither dead nor cancelled, or if another
        live job of its queue holds its dedupe key (retrying would duplicate it).
        """
        check_session(session)
        job_id = check_job_id(job_id)
        return session.execute(self._retry, {"job_id": job_id}, execution_options=_NO_SYNC).first() is not None

    def purge(
        self,
        session: Session,
        *,
        statuses: Sequence[str] = ("done", "dead", "cancelled"),
        older_than: timedelta = timedelta(0),
        limit: int = 1000,
    ) -> int:
        """Delete up to ``limit`` finished jobs older than ``older_than``; return how many."""
        check_session(session)
        statuses = check_statuses(statuses)
        older_than = check_older_than(older_than)
        stmt = statements.purge(
            self.model, statuses=list(statuses), older_than=older_than, limit=positive_int("limit", limit)
        )
        return int(session.execute(stmt, execution_options=_NO_SYNC).rowcount)  # type: ignore[attr-defined]

    def stats(self, session: Session) -> list[QueueStats]:
        """Job counts per queue and status, with the oldest runnable job's age."""
        check_session(session)
        rows = session.execute(statements.stats(self.model)).all()
        return [QueueStats(r.queue, r.status, int(r[2]), r.oldest_runnable_age) for r in rows]


def _runnable_now(row: dict[str, Any]) -> bool:
    """Whether a checked row is runnable at once (no delay, no future run_at)."""
    return not row["delay"] and (row["run_at"] is None or row["run_at"] <= datetime.now(timezone.utc))


def _respec(row: dict[str, Any]) -> JobSpec:
    core = {"task", "payload", "queue", "priority", "run_at", "delay", "max_attempts", "dedupe_key"}
    fields = {k: row[k] for k in core}
    if fields["run_at"] is not None:
        fields["delay"] = None
    return JobSpec(**fields, extra={k: v for k, v in row.items() if k not in core})


__all__ = [
    "JobRepository", "LeaseReport", "QueueStats", "ReapResult", "STATUSES", "cancel_channel_name",
    "default_worker_name",
]
