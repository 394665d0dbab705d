"""JobRepository: the queue verbs, run on a session the caller gives.

::

    emails = JobRepository(EmailJob)
    with Session(engine) as session, session.begin():
        emails.enqueue(session, "send_welcome", {"user_id": 42}, queue="signup")

No verb commits, rolls back or opens a transaction: each runs its statements
on the caller's session, so an enqueue commits (or vanishes) with the
caller's own writes. Verbs after a claim (``complete``, ``fail``,
``heartbeat``, ``extend_leases``, ``hand_back``, ``mark_cancelled``) are
fenced on the claim's ``lock_token``: they change nothing of a job the caller
no longer owns, and the single-job ones raise :class:`JobLostError` then.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from sqlalchemy.orm import Session

from . import housekeeping, statements
from .channels import cancel_channel_name, channel_name
from .checks import (
    check_aware,
    check_bool,
    check_claimed,
    check_claimed_many,
    check_delay,
    check_job_id,
    check_lease,
    check_older_than,
    check_queues,
    check_session,
    check_statuses,
    check_task_limits,
    check_worker_name,
    clean_error,
    positive_int,
)
from .claim import DEFAULT_LEASE, Claimer, default_worker_name
from .completion import Completions
from .dedupe import Dedupe, EnqueueOutcome
from .enqueue import Enqueuer
from .errors import InvalidArgumentError, JobLostError
from .mixin import JobMixin, job_table
from .reports import LeaseReport, QueueStats, ReapResult
from .retry import DEFAULT_RETRY_POLICY, RetryPolicy, check_policy
from .snapshot import Snapshots
from .spec import JobSpec, check_specs, checked_row, checked_rows, plain_fields
from .states import CANCELLED, DEAD, DEFAULT_QUEUE, STATUSES

M = TypeVar("M", bound=JobMixin)

_NO_SYNC = {"synchronize_session": False}


class JobRepository(Generic[M]):
    """The queue verbs for one job model (one table, any number of queues)."""

    def __init__(self, model: type[M], *, notify: bool = True) -> None:
        """Raise :class:`JobTableError` unless ``model`` is a mapped JobMixin
        model that still has its claim, lease and dedupe indexes.

        With ``notify`` (the default), enqueueing runnable jobs sends one
        NOTIFY per transaction and queue on the table's channel, which wakes
        listening workers at commit.
        """
        table = job_table(model)
        self.model = model
        self.table = table
        self.notify = notify
        self.channel = channel_name(table.name)
        self.cancel_channel = cancel_channel_name(table.name)
        self.keep_done: bool = bool(getattr(model, "__keep_done__", False))
        job_columns = {name for name in JobMixin.__annotations__ if not name.startswith("__")}
        self._user_columns = frozenset(c.key for c in table.columns if c.key not in job_columns)
        #: Builds detached snapshots of this table's rows (:mod:`sa_jobqueue.snapshot`):
        #: select its ``columns`` and hand the rows to its ``all``.
        self.snapshots: Snapshots[M] = Snapshots(model, table)
        self._enqueuer = Enqueuer(model, table, self.snapshots, channel=self.channel, copy=not self._user_columns)
        #: The claim behind :meth:`claim`; a worker's claimer threads call its
        #: ``claim_on`` with checked arguments on the connections they hold.
        self.claimer: Claimer[M] = Claimer(model, self.snapshots)
        #: The completions behind :meth:`complete` and :meth:`complete_many`; a worker's
        #: completer calls its ``many_on`` on a connection of the worker's own engine.
        self.completions = Completions(model, keep_done=self.keep_done)
        # Statements are values: built once, reused with new parameters, so the
        # hot path skips construction and hits SQLAlchemy's compiled cache.
        self._fail = statements.fail(model)
        self._heartbeat = statements.heartbeat(model)
        self._hand_back = statements.hand_back(model)
        self._mark_cancelled = statements.mark_cancelled(model)
        self._reap = housekeeping.reap(model)
        self._cancel = housekeeping.cancel(model)
        self._retry = housekeeping.retry(model)

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
        dedupe_key: str | Dedupe | None = None,
        extra: dict[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> M:
        """Insert one job in the caller's transaction and return it (a
        detached snapshot of the row as inserted, see :mod:`sa_jobqueue.snapshot`).

        ``max_attempts``: the job's own limit, which wins over its task's;
        None (the default) leaves the row's NULL, so that the task's
        ``max_attempts`` applies, else 20 (:data:`~sa_jobqueue.mixin.DEFAULT_MAX_ATTEMPTS`).

        With ``dedupe_key``, while a live job of the same queue holds the key,
        that job is returned and nothing is inserted; a :class:`~sa_jobqueue.Dedupe`
        may change it instead (:mod:`sa_jobqueue.dedupe`). ``meta``: what
        travels with the job besides its payload (a JSON object; :class:`JobSpec`).
        """
        session = check_session(session)
        spec = JobSpec(
            task=task, payload=payload, queue=queue, priority=priority, run_at=run_at,
            delay=delay, max_attempts=max_attempts, dedupe_key=dedupe_key, extra=extra or {}, meta=meta,
        )
        row, text = checked_row(spec, self._user_columns)
        if dedupe_key is not None:
            return self._enqueuer.many(session, [row], notify=self.notify)[0]
        return self._enqueuer.one(session, row, notify=self.notify, payload_text=text)

    def enqueue_many(self, session: Session, jobs: Iterable[JobSpec]) -> list[M]:
        """Insert many jobs, one INSERT per group of like rows (batched by
        SQLAlchemy's insertmanyvalues, or COPY for plain rows, see
        :mod:`sa_jobqueue.bulk`), and return them (detached snapshots) in
        input order.

        Every spec is checked before anything is sent. Rows with a dedupe key
        that a live job holds (or that an earlier row of this call holds)
        come back as that job. Rows with a key are written sorted by
        ``(queue, dedupe_key)``, so concurrent calls with overlapping keys
        wait for each other in line instead of deadlocking.
        """
        session = check_session(session)
        rows, texts = checked_rows(jobs, self._user_columns)
        return self._enqueuer.many(session, rows, notify=self.notify, payload_texts=texts)

    def enqueue_many_fast(self, session: Session, jobs: Iterable[JobSpec]) -> int:
        """:meth:`enqueue_many` without the jobs: return how many new jobs the specs made (one whose
        dedupe key a live job holds makes none). Checked, written and notified as there, in the caller's
        transaction; where COPY writes the rows, nothing is read back and no snapshot is built, and each
        spec is checked as its row goes out, in a SAVEPOINT: a bad spec raises
        :class:`InvalidArgumentError` and nothing of the call is written."""
        session = check_session(session)
        columns = self._user_columns
        return self._enqueuer.count(session, check_specs(jobs), lambda spec: checked_row(spec, columns),
                                    plain_fields, notify=self.notify)

    def enqueue_many_report(self, session: Session, jobs: Iterable[JobSpec]) -> list[EnqueueOutcome[M]]:
        """:meth:`enqueue_many`, with, per spec in input order, the job that won its place (new, or
        the holder of its dedupe key) and what the call did (:class:`~sa_jobqueue.EnqueueOutcome`)."""
        session = check_session(session)
        rows, texts = checked_rows(jobs, self._user_columns)
        return self._enqueuer.many_report(session, rows, notify=self.notify, payload_texts=texts)

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

        A claimed job whose payload (or ``meta``, ``result``, ``progress``)
        the client cannot decode (such as JSON nested deeper than Python's
        recursion limit, written by SQL) is not returned: it goes to ``dead``
        at once, in the same session, with ``last_error`` ``payload cannot be
        decoded: <error>`` (``meta cannot be decoded: …``); the other jobs
        of the claim are returned as usual, and when there are none the claim
        is made again, so an empty list still means an empty queue.
        """
        session = check_session(session)
        limit = positive_int("limit", limit)
        lease = check_lease("lease", lease)
        worker = check_worker_name("worker", worker)
        params = {
            "queues": check_queues(queues), "limit": limit,
            "worker": worker or default_worker_name(), "lease": lease,
        }
        return self.claimer.claim(session, params)

    def complete(self, session: Session, job: M) -> None:
        """Finish a claimed job: delete it, or mark it ``done`` when the model
        sets ``__keep_done__``. Raise :class:`JobLostError` if not owned."""
        session = check_session(session)
        check_claimed("job", job, self.model)
        if not self.completions.one(session, job):
            raise JobLostError(job.id, "complete")

    def complete_many(self, session: Session, jobs: Sequence[M]) -> set[int]:
        """Finish many claimed jobs in one fenced statement; return the ids
        finished. A job missing from the result was no longer owned."""
        session = check_session(session)
        return self.completions.many(session, check_claimed_many("jobs", jobs, self.model))

    def fail(self, session: Session, job: M, error: str, *, policy: RetryPolicy = DEFAULT_RETRY_POLICY,
             delay: timedelta | None = None, at: datetime | None = None, max_attempts: int | None = None,
             discard: bool = False) -> str:
        """Record a failed attempt of a claimed job and return its new status.

        The job goes back to ``pending`` after a backoff (``policy``'s delay
        for this attempt, or ``delay``, or at ``at``), or to ``dead`` when
        ``discard`` is set or its attempts reached its limit, or to
        ``cancelled`` (either way) when its cancel was requested while it ran.
        The limit is the one given at enqueue, else ``max_attempts`` (the
        task's own limit, as a worker passes it), else 20. ``error`` is kept
        in ``last_error``. Fenced.
        """
        session = check_session(session)
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
        session = check_session(session)
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
        session = check_session(session)
        jobs = check_claimed_many("jobs", jobs, self.model)
        if not jobs:
            return set()
        params = {"ids": [j.id for j in jobs], "tokens": [j.lock_token for j in jobs]}
        rows = session.execute(self._hand_back, params, execution_options=_NO_SYNC).all()
        if self.notify:
            self._enqueuer.notify_queues(session, {r.queue for r in rows if r.status != CANCELLED})
        return {r.id for r in rows}

    def mark_cancelled(self, session: Session, job: M, reason: str = "cancelled while running") -> None:
        """End a claimed job as ``cancelled`` (``finished_at`` set, no longer
        owned, ``reason`` kept in ``last_error`` as :meth:`fail` keeps its
        error). Raise :class:`JobLostError` if not owned. Fenced."""
        session = check_session(session)
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
        session = check_session(session)
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
        session = check_session(session)
        job_id = check_job_id(job_id)
        params = {"job_id": job_id, "cancel_channel": self.cancel_channel}
        return session.execute(self._cancel, params, execution_options=_NO_SYNC).first() is not None

    def retry(self, session: Session, job_id: int) -> bool:
        """Send a dead or cancelled job back to pending now, with one more
        attempt whatever its limit (see :func:`sa_jobqueue.housekeeping.retry`).

        Return False if the job is neither dead nor cancelled, or if another
        live job of its queue holds its dedupe key (retrying would duplicate it).
        """
        session = check_session(session)
        job_id = check_job_id(job_id)
        return session.execute(self._retry, {"job_id": job_id}, execution_options=_NO_SYNC).first() is not None

    def purge(self, session: Session, *, statuses: Sequence[str] = ("done", "dead", "cancelled"),
              older_than: timedelta = timedelta(0), limit: int = 1000) -> int:
        """Delete up to ``limit`` finished jobs older than ``older_than``; return how many."""
        session = check_session(session)
        statuses = check_statuses(statuses)
        older_than = check_older_than(older_than)
        stmt = housekeeping.purge(
            self.model, statuses=list(statuses), older_than=older_than, limit=positive_int("limit", limit)
        )
        return int(session.execute(stmt, execution_options=_NO_SYNC).rowcount)  # type: ignore[attr-defined]

    def stats(self, session: Session) -> list[QueueStats]:
        """Job counts per queue and status, with the oldest runnable job's age."""
        session = check_session(session)
        rows = session.execute(housekeeping.stats(self.model)).all()
        return [QueueStats(r.queue, r.status, int(r[2]), r.oldest_runnable_age) for r in rows]


def check_repositories(value: object) -> list[JobRepository[Any]]:
    """A worker's ``repositories``: one JobRepository or a non-empty sequence of them."""
    if isinstance(value, JobRepository):
        return [value]
    if not isinstance(value, (Sequence, set, frozenset)) or isinstance(value, str):
        raise InvalidArgumentError("repositories", f"give one or more JobRepository, got {type(value).__name__}")
    repos = list(value)
    if not repos or not all(isinstance(r, JobRepository) for r in repos):
        raise InvalidArgumentError("repositories", "give one or more JobRepository")
    return repos


__all__ = [
    "DEFAULT_LEASE", "JobRepository", "LeaseReport", "QueueStats", "ReapResult", "STATUSES", "cancel_channel_name",
    "check_repositories", "default_worker_name",
]
