"""Property-based tests of the job state machine, against the real PostgreSQL.

Hypothesis drives random sequences of the queue verbs (enqueue, enqueue_many,
claim, complete, complete_many, fail, heartbeat, hand_back, reap, cancel of
pending and of running jobs, retry, purge) and of simulated time (a lease runs out, a scheduled job becomes due) for
three simulated workers. Every snapshot a worker ever claimed is kept, so
stale snapshots (the job reaped and claimed again, finished, deleted, or a
claim that was rolled back) keep trying fenced writes. Some steps interleave
transactions: a claim steps over the rows an uncommitted claim holds; a reap
meets a completion in flight and leaves its row alone; a stale completion in
another thread waits for a reaper's row lock, then finds the job gone.

A small Python model holds the documented rules (docs/concepts.md). After
every step the whole table is read back and compared column by column with
the model, and independent invariants are checked: only the transitions of
the documented diagram happen, attempts move only on a claim (and back on a
hand-back) and stay within their limit, a fenced write without ownership changes no row, and stats()
agrees with the rows.

The database's ``now()`` is fixed within a transaction, so each step reads it
in its own transaction and the model computes every timestamp exactly; time
moves only by UPDATEs to fixed instants in 2000, so no step sleeps and every
lease and back-off is decided. Connections carry lock and statement
timeouts, so no step waits without bound.

A failure prints the steps that led to it; the run is derandomized, so it
replays the same sequences every time. ``SAJQ_SHRINK=1`` shrinks a failing
sequence first (minutes; add ``--timeout=0``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from jobapp import jobs, reports
from sqlalchemy import Engine, Select, Table, create_engine, func, select, text, update
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker

from sa_jobqueue import JobLostError, JobMixin, JobRepository, JobSpec, RetryPolicy
from sa_jobqueue.mixin import CANCELLED, DEAD, DEFAULT_MAX_ATTEMPTS, DONE, PENDING, RUNNING

# Modest on purpose: the whole file runs in seconds, and derandomize makes
# every run replay the same sequences, so a failure reproduces and CI never flakes.
# Shrinking a failure replays hundreds of sequences against the database, for
# minutes, so it is off unless SAJQ_SHRINK=1; the unshrunk steps are printed.
SETTINGS = settings(
    max_examples=50,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=list(Phase) if os.environ.get("SAJQ_SHRINK") == "1" else [Phase.explicit, Phase.generate],
)
# Every wait in a step is bounded: a blocked statement fails the test instead of hanging it.
# Without synchronous_commit a commit does not wait for its WAL flush, which
# makes each step several times faster; what other sessions see is the same.
CONNECT_ARGS = {"options": "-c lock_timeout=15000 -c statement_timeout=30000 -c synchronous_commit=off"}
WAIT_SECONDS = 10.0

WORKERS = ("w0", "w1", "w2")
LIVE = (PENDING, RUNNING)
FINISHED = (DONE, DEAD, CANCELLED)
# Tasks with a task-level limit, below ("strict") or above ("lenient") any
# row's max_attempts (1 to 3), passed the way a worker passes it: to fail() as
# max_attempts and to reap() as task_max_attempts. A limit given at enqueue
# wins; a job enqueued without one (max_attempts NULL) dies by its task's,
# else by 20 ("plain", or a reaper run without the task limits).
TASK_LIMITS = {"strict": 1, "lenient": 4}
TASKS = ("plain", "strict", "lenient")
# Leases far longer than any run, so a lease expires only when a step says so.
LEASES = (timedelta(hours=1), timedelta(days=1))
FENCED_VERBS = ("fail", "complete", "complete_many", "heartbeat", "hand_back")
CANCELLED_WHILE_RUNNING = "cancelled while running: "
POLICY = RetryPolicy(base=timedelta(minutes=10), max_delay=timedelta(hours=2), jitter=0)
# Simulated time: expired leases and due back-offs are moved to distinct
# instants here, so the reap order (by lease_expires_at) is always decided.
EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Row:
    """The columns of one job row that the rules decide."""

    id: int
    task: str
    priority: int
    dedupe_key: str | None
    status: str
    attempts: int
    max_attempts: int | None
    run_at: datetime
    last_error: str | None
    finished_at: datetime | None
    locked_at: datetime | None
    locked_by: str | None
    lease_expires_at: datetime | None
    lock_token: uuid.UUID | None
    cancel_requested_at: datetime | None

    @classmethod
    def select(cls, table: Table) -> Select[Any]:
        """The table's rows with exactly these columns (Core: cheaper than loading models)."""
        return select(*(table.c[f.name] for f in fields(cls)))

    def limit_bound(self, granted: int = 0) -> int:
        """The most attempts the job may have: the limit given at enqueue; for a
        job without one, the highest of its task's and the default (a reaper
        without the task limits applies the default); at least ``granted``,
        the attempts a retry left it with plus one."""
        if self.max_attempts is not None:
            return max(self.max_attempts, granted)
        return max(TASK_LIMITS.get(self.task, 0), DEFAULT_MAX_ATTEMPTS, granted)

    def limit(self, task_limit: int | None) -> int:
        """The limit a failure applies: the one given at enqueue, else ``task_limit``, else the default."""
        if self.max_attempts is not None:
            return self.max_attempts
        return DEFAULT_MAX_ATTEMPTS if task_limit is None else task_limit


RELEASED: dict[str, Any] = {"locked_at": None, "locked_by": None, "lease_expires_at": None, "lock_token": None}


@dataclass(frozen=True)
class Spec:
    """One job to enqueue, as Hypothesis draws it."""

    task: str
    priority: int
    delayed: bool
    max_attempts: int | None
    dedupe_key: str | None

    def delay(self) -> timedelta:
        """How long after enqueue the job becomes runnable."""
        return timedelta(hours=1) if self.delayed else timedelta(0)

    def job_spec(self) -> JobSpec:
        """The spec for enqueue_many."""
        return JobSpec(
            self.task, priority=self.priority, delay=self.delay() if self.delayed else None,
            max_attempts=self.max_attempts, dedupe_key=self.dedupe_key,
        )


@dataclass(frozen=True)
class Backoff:
    """How a fail() names the retry time: ``delay``, ``at``, or neither (the policy)."""

    delay: timedelta | None = None
    at: datetime | None = None

    def run_at(self, now: datetime, attempts: int) -> datetime:
        """The run_at the rules give a failed attempt that is retried."""
        if self.at is not None:
            return self.at
        if self.delay is not None:
            return now + self.delay
        seconds = min(POLICY.base.total_seconds() * 2 ** (attempts - 1), POLICY.max_delay.total_seconds())
        return now + timedelta(seconds=seconds)


BACKOFFS = (
    Backoff(delay=timedelta(0)),
    Backoff(delay=timedelta(hours=1)),
    Backoff(at=datetime(2001, 1, 1, tzinfo=timezone.utc)),
    Backoff(at=datetime(2100, 1, 1, tzinfo=timezone.utc)),
    Backoff(),
)


@dataclass(frozen=True)
class Held:
    """A worker's snapshot of a job it claimed, kept after it went stale.

    ``phantom``: the claim was rolled back, so its token never existed.
    """

    worker: str
    job: JobMixin
    token: uuid.UUID
    phantom: bool = False

    @property
    def id(self) -> int:
        """The claimed job's id."""
        return self.job.id

    def __repr__(self) -> str:
        kind = "phantom " if self.phantom else ""
        return (
            f"<{kind}claim of job {self.id} by {self.worker}, attempt {self.job.attempts}, token {self.token.hex[:8]}>"
        )


# A limit given at enqueue, or none (NULL: the task's applies, else 20).
limits = st.one_of(st.none(), st.integers(1, 3))
specs = st.builds(
    Spec,
    task=st.sampled_from(TASKS),
    priority=st.integers(-1, 1),
    delayed=st.booleans(),
    max_attempts=limits,
    # One key, often: holders, repeats in one call, and retry meeting a live holder.
    dedupe_key=st.sampled_from((None, "k")),
)
# A backlog to start from, so that claims find work from the first step on.
backlogs = st.lists(
    st.builds(Spec, task=st.sampled_from(TASKS), priority=st.integers(-1, 1), delayed=st.just(False),
              max_attempts=limits, dedupe_key=st.just(None)),
    min_size=2, max_size=6,
)
workers = st.sampled_from(WORKERS)
# Three times in four an interleaving step races an owner's snapshot (the race that
# matters), else any snapshot.
MOSTLY = st.sampled_from((True, True, True, False))
leases = st.sampled_from(LEASES)
# Any text, NUL and lone surrogates included: fail() must store it whatever it is.
errors = st.one_of(
    st.sampled_from(("boom", "bad \x00 byte", "lone \ud800 surrogate")),
    st.text(st.characters(exclude_categories=()), max_size=12),
)


def stored_error(error: str) -> str:
    """The last_error the documented rule keeps for a short ``error``: NUL and
    lone surrogates (which PostgreSQL text cannot hold) become U+FFFD."""
    return "".join("\ufffd" if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in error)


def _legal_transitions(keep_done: bool) -> set[tuple[str | None, str | None]]:
    """The documented diagram, with None for "no row" (before enqueue, after delete)."""
    legal: set[tuple[str | None, str | None]] = {
        (None, PENDING),
        (PENDING, RUNNING), (PENDING, CANCELLED),
        (RUNNING, PENDING), (RUNNING, DEAD), (RUNNING, CANCELLED), (RUNNING, DONE if keep_done else None),
        (DEAD, PENDING), (CANCELLED, PENDING),
        (DONE, None), (DEAD, None), (CANCELLED, None),
    }
    return legal | {(status, status) for status in (PENDING, RUNNING, DONE, DEAD, CANCELLED)}


def _has(*statuses: str) -> Callable[[QueueMachine], bool]:
    """A precondition: some job of the model is in one of ``statuses``."""

    def check(machine: QueueMachine) -> bool:
        return any(row.status in statuses for row in machine.model.values())

    return check


def _has_snapshots(machine: QueueMachine) -> bool:
    """A precondition: some worker claimed something."""
    return bool(machine.snapshots)


def _has_stale_snapshots(machine: QueueMachine) -> bool:
    """A precondition: some snapshot no longer owns its job."""
    return any(not machine._owns(h) for h in machine.snapshots)


def _time_can_pass(machine: QueueMachine) -> bool:
    """A job whose lease can run out, or one scheduled later that can become due."""
    return any(
        r.status == RUNNING or (r.status == PENDING and r.run_at > machine.last_now) for r in machine.model.values()
    )


class QueueMachine(RuleBasedStateMachine):
    """Random verb sequences on one job table, checked against a model of the rules.

    Steps pick their snapshots and jobs from the machine's own lists (not
    Bundles) so that a draw can favour the interesting ones: mostly an
    owner's snapshot, or a job in a status the verb acts on.
    """

    repo: ClassVar[JobRepository[Any]]
    sessions: ClassVar[sessionmaker[Session]]

    def __init__(self) -> None:
        super().__init__()
        with self.sessions.begin() as session:
            session.execute(text(f"TRUNCATE {self.repo.table.name}"))
        self.model: dict[int, Row] = {}
        # The table as last read: the state before the current step.
        self.observed: dict[int, Row] = {}
        # Every snapshot any worker ever claimed, in claim order; never pruned.
        self.snapshots: list[Held] = []
        self.ids_seen: list[int] = []
        self.tokens_seen: set[uuid.UUID] = set()
        self.last_now = EPOCH
        self.clock = 0
        # Per job retried, its attempts then plus one: the attempt a retry grants.
        self.granted: dict[int, int] = {}
        # The jobs handed back since the last check: their claim's attempt was taken back.
        self.handed_back: set[int] = set()
        self.legal = _legal_transitions(self.repo.keep_done)

    # -- helpers -----------------------------------------------------------

    def _now(self, session: Session) -> datetime:
        """The session's transaction time: the now() every statement of it sees."""
        now: datetime = session.execute(select(func.now())).scalar_one()
        self.last_now = max(self.last_now, now)
        return now

    @contextmanager
    def _tx(self) -> Iterator[tuple[Session, datetime]]:
        """One committed transaction and its now(), the instant its statements see."""
        with self.sessions.begin() as session:
            yield session, self._now(session)

    def _tick(self) -> datetime:
        """A fresh instant in the simulated past, later than the previous one."""
        self.clock += 1
        return EPOCH + timedelta(seconds=self.clock)

    def _set(self, job_id: int, **changes: Any) -> None:
        """Change columns of a job in the model."""
        self.model[job_id] = replace(self.model[job_id], **changes)

    def _owns(self, held: Held) -> bool:
        """Whether the snapshot still owns its job, by the model."""
        row = self.model.get(held.id)
        return row is not None and row.status == RUNNING and row.lock_token == held.token

    def _ownership(self, verb: str, held: Held) -> bool:
        """Whether the snapshot still owns its job; labels the case for --hypothesis-show-statistics."""
        row = self.model.get(held.id)
        if self._owns(held):
            kind = "owner"
        elif held.phantom:
            kind = "phantom (claim rolled back)"
        elif row is None:
            kind = "stale, job deleted"
        elif row.status == RUNNING:
            kind = "stale, job claimed again"
        else:
            kind = f"stale, job {row.status}"
        event(f"{verb}: {kind}")
        return kind == "owner"

    def _pick_snapshots(self, data: st.DataObject, verb: str, most: int = 1) -> list[Held]:
        """One to ``most`` snapshots: from the owners' (if any) or from all, stale ones included."""
        owners = [h for h in self.snapshots if self._owns(h)]
        from_owners: bool = bool(owners) and data.draw(MOSTLY, label="from the owners")
        pool = owners if from_owners else self.snapshots
        return data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=most), label=verb)

    def _pick_job(self, data: st.DataObject, verb: str, statuses: Sequence[str]) -> int:
        """Half the time a job in one of ``statuses`` (the verb acts on it),
        half the time another job ever enqueued, deleted ones included."""
        fitting = sorted(r.id for r in self.model.values() if r.status in statuses)
        others = [i for i in self.ids_seen if i not in fitting]
        from_fitting: bool = bool(fitting) and (not others or data.draw(st.booleans(), label="in a fitting status"))
        pool = fitting if from_fitting else others
        job_id: int = data.draw(st.sampled_from(pool), label=verb)
        return job_id

    def _claimable(self, now: datetime, skip: Iterable[int] = ()) -> list[Row]:
        """The runnable jobs at ``now``, in claim order (priority, run_at, id)."""
        skipped = set(skip)
        runnable = [r for r in self.model.values() if r.status == PENDING and r.run_at <= now and r.id not in skipped]
        return sorted(runnable, key=lambda r: (r.priority, r.run_at, r.id))

    def _expired(self, now: datetime, skip: Iterable[int] = ()) -> list[Row]:
        """The running jobs whose lease expired before ``now``, in reap order."""
        skipped = set(skip)
        expired = [
            r for r in self.model.values()
            if r.status == RUNNING and r.lease_expires_at is not None and r.lease_expires_at < now
            and r.id not in skipped
        ]
        return sorted(expired, key=lambda r: (r.lease_expires_at, r.id))

    def _rows(self, session: Session, job_ids: Iterable[int] | None = None) -> dict[int, Row]:
        """The table's rows (or those of ``job_ids``) by id."""
        stmt = Row.select(self.repo.table)
        if job_ids is not None:
            stmt = stmt.where(self.repo.table.c.id.in_(sorted(set(job_ids))))
        return {row.id: Row(**row._mapping) for row in session.execute(stmt)}

    def _read(self, job_ids: Iterable[int]) -> dict[int, Row]:
        """The rows of ``job_ids`` as committed now."""
        with self.sessions() as session:
            return self._rows(session, job_ids)

    def _assert_untouched(self, job_ids: Iterable[int], verb: str) -> None:
        """A fenced write without ownership left these rows exactly as they were."""
        ids = set(job_ids)
        if not ids:
            return
        before = {i: self.observed[i] for i in ids if i in self.observed}
        assert self._read(ids) == before, f"a stale {verb} changed jobs {sorted(ids)}"

    def _expire(self, job_id: int) -> bool:
        """Move a running job's lease into the simulated past; whether it was running."""
        at = self._tick()
        t = self.repo.table
        with self._tx() as (session, _):
            changed = session.execute(
                update(t).where(t.c.id == job_id, t.c.status == RUNNING).values(lease_expires_at=at).returning(t.c.id)
            ).all()
        running = job_id in self.model and self.model[job_id].status == RUNNING
        assert len(changed) == (1 if running else 0)
        if running:
            self._set(job_id, lease_expires_at=at)
        return running

    # -- model transitions -------------------------------------------------

    def _enqueued(self, drawn: Sequence[Spec], returned: Sequence[int], now: datetime) -> None:
        """Check the ids an enqueue returned and add the new jobs to the model."""
        assert len(returned) == len(drawn)
        holders = {r.dedupe_key: r.id for r in self.model.values() if r.dedupe_key and r.status in LIVE}
        for spec, job_id in zip(drawn, returned, strict=True):
            holder = holders.get(spec.dedupe_key) if spec.dedupe_key else None
            if holder is not None:
                event("enqueue: dedupe key held")
                assert job_id == holder, f"dedupe key {spec.dedupe_key!r} is held by job {holder}, got {job_id}"
                continue
            assert job_id not in self.ids_seen, f"enqueue returned job {job_id} as new, an id seen before"
            self.ids_seen.append(job_id)
            self.model[job_id] = Row(
                id=job_id, task=spec.task, priority=spec.priority, dedupe_key=spec.dedupe_key, status=PENDING,
                attempts=0, max_attempts=spec.max_attempts, run_at=now + spec.delay(), last_error=None,
                finished_at=None, cancel_requested_at=None, **RELEASED,
            )
            if spec.dedupe_key:
                holders[spec.dedupe_key] = job_id

    def _claimed(self, claimed: Sequence[Any], expected: Sequence[Row], worker: str) -> list[Held]:
        """Check a claim against the model's choice; return the snapshots (model not yet updated)."""
        assert [job.id for job in claimed] == [r.id for r in expected], "claim took other jobs than the rules say"
        held = []
        for job, row in zip(claimed, expected, strict=True):
            token = job.lock_token
            assert token is not None and token not in self.tokens_seen, "every claim needs a fresh lock_token"
            self.tokens_seen.add(token)
            assert (job.status, job.attempts, job.locked_by) == (RUNNING, row.attempts + 1, worker)
            held.append(Held(worker, job, token))
        return held

    def _apply_claim(self, held: Sequence[Held], lease: timedelta, now: datetime) -> None:
        """A committed claim: the jobs run under the snapshots' tokens."""
        for h in held:
            if self.model[h.id].attempts > 0:
                event("claim: a job that ran before")
            self._set(
                h.id, status=RUNNING, attempts=self.model[h.id].attempts + 1, locked_at=now, locked_by=h.worker,
                lease_expires_at=now + lease, lock_token=h.token,
            )
        self.snapshots.extend(held)

    def _completed(self, job_id: int, now: datetime) -> None:
        """A completion: the job is deleted, or kept as done (a cancel request
        of it, too late, changes nothing)."""
        if self.model[job_id].cancel_requested_at is not None:
            event("completion of a job whose cancel was requested")
        if self.repo.keep_done:
            # A kept job records who ran it: locked_at and locked_by stay.
            self._set(job_id, status=DONE, finished_at=now, lease_expires_at=None, lock_token=None)
        else:
            del self.model[job_id]

    def _reap(
        self, now: datetime, limit: int, task_limits: bool, skip: Iterable[int] = ()
    ) -> tuple[int, int, int]:
        """A reap at ``now`` in the model; returns (requeued, dead, cancelled) as ReapResult counts them."""
        requeued = dead = cancelled = 0
        for row in self._expired(now, skip)[:limit]:
            ceiling = row.limit(TASK_LIMITS.get(row.task) if task_limits else None)
            error = f"lease expired at attempt {row.attempts} (worker {row.locked_by or 'unknown'})"
            if row.cancel_requested_at is not None:
                cancelled += 1
                self._set(row.id, status=CANCELLED, finished_at=now, last_error=CANCELLED_WHILE_RUNNING + error,
                          **RELEASED)
            elif row.attempts >= ceiling:
                dead += 1
                self._set(row.id, status=DEAD, finished_at=now, last_error=error, **RELEASED)
            else:
                requeued += 1
                # run_at is kept: runnable at once (it was, to be claimed), in
                # its old place in the queue.
                assert row.run_at <= now
                self._set(row.id, status=PENDING, finished_at=None, last_error=error, **RELEASED)
        event(f"reap: requeued {min(requeued, 2)}+, dead {min(dead, 2)}+, cancelled {min(cancelled, 1)}+")
        return requeued, dead, cancelled

    # -- rules: producers ----------------------------------------------------

    @initialize(drawn=backlogs)
    def backlog(self, drawn: list[Spec]) -> None:
        """Runnable jobs to start from."""
        self.enqueue_many(drawn)

    @rule(spec=specs)
    def enqueue(self, spec: Spec) -> None:
        """One job, or the live job already holding its dedupe key."""
        with self._tx() as (session, now):
            job = self.repo.enqueue(
                session, spec.task, priority=spec.priority, delay=spec.delay() if spec.delayed else None,
                max_attempts=spec.max_attempts, dedupe_key=spec.dedupe_key,
            )
        self._enqueued([spec], [job.id], now)

    @rule(drawn=st.lists(specs, min_size=1, max_size=4))
    def enqueue_many(self, drawn: list[Spec]) -> None:
        """Jobs in one call, repeated dedupe keys included."""
        with self._tx() as (session, now):
            created = self.repo.enqueue_many(session, [spec.job_spec() for spec in drawn])
        self._enqueued(drawn, [int(job.id) for job in created], now)

    @precondition(_has(PENDING))
    @rule(worker=workers, limit=st.integers(1, 3), lease=leases)
    def claim(self, worker: str, limit: int, lease: timedelta) -> None:
        """A worker claims the first ``limit`` runnable jobs in claim order."""
        with self._tx() as (session, now):
            claimed = self.repo.claim(session, limit=limit, worker=worker, lease=lease)
        held = self._claimed(claimed, self._claimable(now)[:limit], worker)
        event(f"claim: {len(held)} of {limit}")
        self._apply_claim(held, lease, now)

    # -- fenced writes of a (maybe stale) worker ------------------------------

    def _complete(self, h: Held) -> None:
        """Finish the job, or get JobLostError when the snapshot no longer owns it."""
        owned = self._ownership("complete", h)
        with self._tx() as (session, now):
            if owned:
                self.repo.complete(session, h.job)
            else:
                with pytest.raises(JobLostError) as lost:
                    self.repo.complete(session, h.job)
                assert (lost.value.job_id, lost.value.verb) == (h.id, "complete")
        if owned:
            self._completed(h.id, now)
        else:
            self._assert_untouched([h.id], "complete")

    def _complete_many(self, hs: Sequence[Held]) -> None:
        """Finish, in one statement, the jobs the snapshots still own."""
        owned = {h.id for h in hs if self._ownership("complete_many", h)}
        with self._tx() as (session, now):
            finished = self.repo.complete_many(session, [h.job for h in hs])
        assert finished == owned, "complete_many must finish exactly the jobs still owned"
        for job_id in owned:
            self._completed(job_id, now)
        self._assert_untouched({h.id for h in hs} - owned, "complete_many")

    def _fail(self, h: Held, backoff: Backoff, discard: bool, error: str) -> None:
        """Record a failed attempt, or get JobLostError when the snapshot no longer owns it."""
        owned = self._ownership("fail", h)
        # As a worker does: the task's own limit, for a job enqueued without one.
        task_limit = TASK_LIMITS.get(h.job.task)

        def fail(session: Session) -> str:
            return self.repo.fail(
                session, h.job, error, policy=POLICY, delay=backoff.delay, at=backoff.at,
                max_attempts=task_limit, discard=discard,
            )

        with self._tx() as (session, now):
            if owned:
                status = fail(session)
            else:
                with pytest.raises(JobLostError) as lost:
                    fail(session)
                assert (lost.value.job_id, lost.value.verb) == (h.id, "fail")
        if not owned:
            self._assert_untouched([h.id], "fail")
            return
        row = self.model[h.id]
        limit = row.limit(task_limit)
        dead = discard or row.attempts >= limit
        requested = row.cancel_requested_at is not None
        why = "discarded" if discard else f"attempt {row.attempts} of {limit}"
        whose = "given at enqueue" if row.max_attempts is not None else "task's" if task_limit else "default"
        event(f"fail: {'cancelled (requested)' if requested else 'dead' if dead else 'retried'}, {why}, limit {whose}")
        if stored_error(error) != error:
            event("fail: error text with NUL or a lone surrogate")
        assert status == (CANCELLED if requested else DEAD if dead else PENDING)
        if requested or dead:
            ended = CANCELLED if requested else DEAD
            self._set(h.id, status=ended, finished_at=now, last_error=stored_error(error), **RELEASED)
        else:
            run_at = backoff.run_at(now, row.attempts)
            self._set(
                h.id, status=PENDING, run_at=run_at, finished_at=None, last_error=stored_error(error), **RELEASED
            )

    def _heartbeat(self, hs: Sequence[Held], lease: timedelta) -> None:
        """Extend the leases of the snapshots that still own their jobs (heartbeat
        is extend_leases' ``owned``); learn which of them have a cancel request."""
        owned = {h.id for h in hs if self._ownership("heartbeat", h)}
        with self._tx() as (session, now):
            report = self.repo.extend_leases(session, [h.job for h in hs], lease=lease)
        assert report.owned == owned, "heartbeat must extend exactly the jobs still owned"
        requested = {i for i in owned if self.model[i].cancel_requested_at is not None}
        assert report.cancel_requested == requested, "a heartbeat reports exactly the owned jobs with a cancel request"
        if requested:
            event("heartbeat: learns of a cancel request")
        for job_id in owned:
            self._set(job_id, lease_expires_at=now + lease)
        self._assert_untouched({h.id for h in hs} - owned, "heartbeat")

    def _hand_back(self, hs: Sequence[Held]) -> None:
        """Give back, in one statement, the jobs the snapshots still own (they
        never started): pending again with the claim's attempt taken back, or
        cancelled when their cancel was requested meanwhile."""
        owned = {h.id for h in hs if self._ownership("hand_back", h)}
        with self._tx() as (session, now):
            given_back = self.repo.hand_back(session, [h.job for h in hs])
        assert given_back == owned, "hand_back must give back exactly the jobs still owned"
        for job_id in owned:
            row = self.model[job_id]
            self.handed_back.add(job_id)
            if row.cancel_requested_at is not None:
                event("hand_back: cancelled (requested)")
                self._set(job_id, status=CANCELLED, attempts=row.attempts - 1, finished_at=now, **RELEASED)
            else:
                self._set(job_id, status=PENDING, attempts=row.attempts - 1, finished_at=None, **RELEASED)
        self._assert_untouched({h.id for h in hs} - owned, "hand_back")

    # -- rules: fenced writes ----------------------------------------------------

    def _write(self, verb: str, hs: Sequence[Held], backoff: Backoff, discard: bool, error: str,
               lease: timedelta) -> None:
        """One fenced write: ``complete`` and ``fail`` take the first snapshot, the batched verbs all."""
        if verb == "complete":
            self._complete(hs[0])
        elif verb == "fail":
            self._fail(hs[0], backoff, discard, error)
        elif verb == "complete_many":
            self._complete_many(hs)
        elif verb == "hand_back":
            self._hand_back(hs)
        else:
            self._heartbeat(hs, lease)

    def _owner(self, data: st.DataObject) -> Held:
        """A snapshot that still owns its job."""
        owners = [h for h in self.snapshots if self._owns(h)]
        return data.draw(st.sampled_from(owners), label="owner")

    @precondition(_has(RUNNING))
    @rule(data=st.data(), verb=st.sampled_from(("complete", "complete_many", "heartbeat", "hand_back")),
          lease=leases)
    def work(self, data: st.DataObject, verb: str, lease: timedelta) -> None:
        """A worker that owns its job completes it, extends its lease or (stopping)
        hands it back unstarted; the batched verbs take other snapshots along,
        stale ones included."""
        h = self._owner(data)
        others = data.draw(st.lists(st.sampled_from(self.snapshots), max_size=2), label="along")
        self._write(verb, [h, *others], BACKOFFS[0], False, "", lease)

    @precondition(_has(RUNNING))
    @rule(data=st.data(), backoff=st.sampled_from(BACKOFFS), discard=st.sampled_from((False, False, True)),
          error=errors)
    def work_fails(self, data: st.DataObject, backoff: Backoff, discard: bool, error: str) -> None:
        """A worker's job fails: retried later, or dead (attempts used up, or discarded)."""
        self._fail(self._owner(data), backoff, discard, error)

    @precondition(_has_stale_snapshots)
    @rule(
        data=st.data(), verb=st.sampled_from(FENCED_VERBS), backoff=st.sampled_from(BACKOFFS),
        discard=st.booleans(), error=errors, lease=leases,
    )
    def stale_write(self, data: st.DataObject, verb: str, backoff: Backoff, discard: bool, error: str,
                    lease: timedelta) -> None:
        """A worker whose snapshot went stale (job reaped, claimed again, finished,
        deleted, or a claim rolled back) tries a fenced write anyway."""
        stale = [h for h in self.snapshots if not self._owns(h)]
        hs = data.draw(st.lists(st.sampled_from(stale), min_size=1, max_size=3), label="stale")
        self._write(verb, hs, backoff, discard, error, lease)

    @precondition(_has(RUNNING))
    @rule(data=st.data(), taker=workers, lease=leases, task_limits=st.booleans())
    def take_over(self, data: st.DataObject, taker: str, lease: timedelta, task_limits: bool) -> None:
        """A worker stalls past its lease; a reaper sends its job back (or to
        dead); a worker, maybe the same one, claims it again; then the stalled
        worker wakes up and tries every fenced write with its stale snapshot."""
        owners = [h for h in self.snapshots if self._owns(h)]
        h = data.draw(st.sampled_from(owners), label="stalled")
        self._expire(h.id)
        with self._tx() as (session, now):
            result = self.repo.reap(session, task_max_attempts=TASK_LIMITS if task_limits else None)
        assert (result.requeued, result.dead, result.cancelled) == self._reap(now, 1000, task_limits)
        # Each transition on its own: the invariant allows one per job and check.
        self.table_matches_the_rules()
        if self.model[h.id].status == PENDING:
            with self._tx() as (session, now):
                queue = self._claimable(now)
                ids = [r.id for r in queue]
                # Claim everything ahead of the reaped job too, so that it is taken.
                limit = ids.index(h.id) + 1 if h.id in ids else 1
                claimed = self.repo.claim(session, limit=limit, worker=taker, lease=lease)
            self._apply_claim(self._claimed(claimed, queue[:limit], taker), lease, now)
            # The state the stale write must leave alone.
            self.table_matches_the_rules()
        self._heartbeat([h], lease)
        self._hand_back([h])
        self._fail(h, BACKOFFS[0], discard=False, error="stale")
        self._complete_many([h])
        self._complete(h)

    # -- rules: simulated time -------------------------------------------------

    @precondition(_time_can_pass)
    @rule(data=st.data())
    def time_passes(self, data: st.DataObject) -> None:
        """Time passes for one job: a running job's lease runs out (its worker
        stalled), or a job scheduled later becomes due."""
        running = sorted(r.id for r in self.model.values() if r.status == RUNNING)
        future = sorted(r.id for r in self.model.values() if r.status == PENDING and r.run_at > self.last_now)
        kinds = [kind for kind, ids in (("lease runs out", running), ("job becomes due", future)) if ids]
        kind = data.draw(st.sampled_from(kinds), label="what")
        if kind == "lease runs out":
            self._expire(data.draw(st.sampled_from(running), label="job"))
            return
        job_id = data.draw(st.sampled_from(future), label="job")
        at = self._tick()
        t = self.repo.table
        with self._tx() as (session, _):
            changed = session.execute(
                update(t).where(t.c.id == job_id, t.c.status == PENDING).values(run_at=at).returning(t.c.id)
            ).all()
        assert len(changed) == 1
        self._set(job_id, run_at=at)

    # -- rules: housekeeping -----------------------------------------------------

    @precondition(_has(RUNNING))
    @rule(limit=st.sampled_from((1, 2, 1000)), task_limits=st.booleans())
    def reap(self, limit: int, task_limits: bool) -> None:
        """A reaper takes back up to ``limit`` expired leases, oldest first."""
        with self._tx() as (session, now):
            result = self.repo.reap(session, limit=limit, task_max_attempts=TASK_LIMITS if task_limits else None)
        assert (result.requeued, result.dead, result.cancelled) == self._reap(now, limit, task_limits)

    @precondition(_has(PENDING, RUNNING, DEAD, CANCELLED))
    @rule(data=st.data(), verb=st.sampled_from(("retry", "cancel")))
    def operator(self, data: st.DataObject, verb: str) -> None:
        """An operator retries a dead or cancelled job, or cancels a pending or
        running one (mostly jobs in those statuses, sometimes any job, deleted
        ones included)."""
        if verb == "cancel":
            self._cancel(self._pick_job(data, "cancel", LIVE))
        else:
            self._retry(self._pick_job(data, "retry", [DEAD, CANCELLED]))

    @precondition(_has(RUNNING))
    @rule(data=st.data())
    def cancel_running(self, data: st.DataObject) -> None:
        """An operator cancels a running job: the request is recorded, and the
        job's next exit from running decides (a completion completes it; a
        failure, a hand-back or a reap ends it cancelled)."""
        running = sorted(r.id for r in self.model.values() if r.status == RUNNING)
        self._cancel(data.draw(st.sampled_from(running), label="cancel a running job"))

    def _cancel(self, job_id: int) -> None:
        """Cancel a job: a pending one is cancelled at once; a running one stays
        running with the request recorded (the first request's time kept)."""
        with self._tx() as (session, now):
            accepted = self.repo.cancel(session, job_id)
        row = self.model.get(job_id)
        assert accepted == (row is not None and row.status in LIVE)
        again = row is not None and row.cancel_requested_at is not None
        event(f"cancel: a job {row.status if row else 'deleted'}{', requested before' if again else ''}")
        if not accepted or row is None:
            return
        if row.status == PENDING:
            self._set(job_id, status=CANCELLED, finished_at=now)
        else:
            self._set(job_id, cancel_requested_at=row.cancel_requested_at or now)

    def _retry(self, job_id: int) -> None:
        """Retry a job; only a dead or cancelled one whose dedupe key is free is."""
        with self._tx() as (session, now):
            retried = self.repo.retry(session, job_id)
        row = self.model.get(job_id)
        key_taken = row is not None and row.dedupe_key is not None and any(
            r.dedupe_key == row.dedupe_key and r.status in LIVE for r in self.model.values()
        )
        assert retried == (row is not None and row.status in (DEAD, CANCELLED) and not key_taken)
        event(f"retry: {retried}" + (", dedupe key taken" if key_taken and row and row.status in FINISHED else ""))
        if retried and row is not None:
            # A limit given at enqueue grows to attempts + 1; none given stays none.
            limit = None if row.max_attempts is None else max(row.max_attempts, row.attempts + 1)
            self.granted[job_id] = row.attempts + 1
            self._set(job_id, status=PENDING, run_at=now, finished_at=None, max_attempts=limit,
                      cancel_requested_at=None)

    @precondition(_has(*FINISHED))
    @rule(
        statuses=st.lists(st.sampled_from(FINISHED), min_size=1, max_size=3, unique=True),
        older_than=st.sampled_from((timedelta(0), timedelta(days=1))),
    )
    def purge(self, statuses: list[str], older_than: timedelta) -> None:
        """Finished jobs in ``statuses`` that finished before ``older_than`` ago are deleted."""
        with self._tx() as (session, now):
            purged = self.repo.purge(session, statuses=statuses, older_than=older_than)
        gone = [
            r.id for r in self.model.values()
            if r.status in statuses and r.finished_at is not None and r.finished_at < now - older_than
        ]
        assert purged == len(gone)
        event(f"purge: {min(purged, 1)}+")
        for job_id in gone:
            del self.model[job_id]

    # -- rules: two transactions at once -----------------------------------------

    @precondition(_has(PENDING))
    @rule(
        first=workers, first_limit=st.integers(1, 2), commit_first=st.booleans(),
        second=workers, second_limit=st.integers(1, 3), lease=leases,
    )
    def claim_past_an_uncommitted_claim(
        self, first: str, first_limit: int, commit_first: bool, second: str, second_limit: int, lease: timedelta
    ) -> None:
        """A second claimer skips the rows a first, uncommitted claim holds; the
        first then commits, or rolls back (transaction mode's crash) and its
        claim never happened: its snapshots stay behind as phantoms."""
        a = self.sessions()
        try:
            a.begin()
            a_now = self._now(a)
            a_claimed = self.repo.claim(a, limit=first_limit, worker=first, lease=lease)
            # Detached, the snapshots survive the rollback, which expires what a session holds.
            a.expunge_all()
            a_held = self._claimed(a_claimed, self._claimable(a_now)[:first_limit], first)
            with self._tx() as (b, b_now):
                b_claimed = self.repo.claim(b, limit=second_limit, worker=second, lease=lease)
            taken = [h.id for h in a_held]
            b_held = self._claimed(b_claimed, self._claimable(b_now, skip=taken)[:second_limit], second)
            if commit_first:
                a.commit()
            else:
                a.rollback()
        finally:
            a.close()
        event(f"claim past an uncommitted claim: {len(a_held)} held, {len(b_held)} taken past them")
        self._apply_claim(b_held, lease, b_now)
        if commit_first:
            self._apply_claim(a_held, lease, a_now)
        else:
            self.snapshots.extend(replace(h, phantom=True) for h in a_held)

    @precondition(_has_snapshots)
    @rule(data=st.data(), stalled=st.booleans(), commit_complete=st.booleans(), task_limits=st.booleans())
    def reap_while_a_completion_is_in_flight(
        self, data: st.DataObject, stalled: bool, commit_complete: bool, task_limits: bool
    ) -> None:
        """A reaper leaves alone a job whose worker is finishing it right now
        (row locked by an uncommitted complete), even with its lease expired
        (``stalled``); the completion then commits or rolls back."""
        [h] = self._pick_snapshots(data, "complete during a reap")
        if stalled and self._owns(h):
            self._expire(h.id)
        owned = self._ownership("complete during a reap", h)
        a = self.sessions()
        try:
            a.begin()
            a_now = self._now(a)
            if owned:
                self.repo.complete(a, h.job)
            else:
                with pytest.raises(JobLostError):
                    self.repo.complete(a, h.job)
            with self._tx() as (b, b_now):
                result = self.repo.reap(b, task_max_attempts=TASK_LIMITS if task_limits else None)
            if commit_complete:
                a.commit()
            else:
                a.rollback()
        finally:
            a.close()
        in_flight = [h.id] if owned else []
        if owned and h.id in {r.id for r in self._expired(b_now)}:
            event("complete during a reap: lease expired, the reaper skipped the row")
        assert (result.requeued, result.dead, result.cancelled) == self._reap(b_now, 1000, task_limits, skip=in_flight)
        if owned and commit_complete:
            self._completed(h.id, a_now)

    @precondition(_has_snapshots)
    @rule(data=st.data(), task_limits=st.booleans())
    def stale_complete_waits_for_the_reaper(self, data: st.DataObject, task_limits: bool) -> None:
        """The worker stalls past its lease; a reaper takes the row (uncommitted)
        while the worker completes it from another thread: the completion
        waits for the reaper's row lock, then finds the job gone (JobLostError)."""
        [h] = self._pick_snapshots(data, "complete racing a reap")
        if self._owns(h):
            self._expire(h.id)
        outcome: dict[str, Any] = {}
        started = threading.Event()

        def complete_in_thread() -> None:
            try:
                with self.sessions.begin() as session:
                    pid, now = session.execute(select(func.pg_backend_pid(), func.now())).one()
                    outcome.update(pid=pid, now=now)
                    started.set()
                    self.repo.complete(session, h.job)
                outcome["result"] = "completed"
            except JobLostError as exc:
                outcome["result"] = exc
            except BaseException as exc:  # reported by the main thread
                outcome["error"] = exc
            finally:
                started.set()

        b = self.sessions()
        thread = threading.Thread(target=complete_in_thread, daemon=True)
        try:
            b.begin()
            b_now = self._now(b)
            result = self.repo.reap(b, task_max_attempts=TASK_LIMITS if task_limits else None)
            reaped_here = {r.id for r in self._expired(b_now)}
            thread.start()
            if self._owns(h) and h.id in reaped_here:
                event("complete racing a reap: waited for the reaper's lock")
                assert started.wait(WAIT_SECONDS), "the completing thread did not start"
                self._wait_until_blocked(outcome)
            b.commit()
        finally:
            b.close()
        thread.join(WAIT_SECONDS * 2)
        assert not thread.is_alive(), "the completion never returned"
        if "error" in outcome:
            raise outcome["error"]
        assert (result.requeued, result.dead, result.cancelled) == self._reap(b_now, 1000, task_limits)
        if self._owns(h):
            assert outcome["result"] == "completed"
            self._completed(h.id, outcome["now"])
        else:
            lost = outcome["result"]
            assert isinstance(lost, JobLostError) and lost.job_id == h.id
            self._ownership("complete racing a reap", h)

    def _wait_until_blocked(self, outcome: dict[str, Any]) -> None:
        """Wait (bounded) until the completing backend waits for a row lock."""
        deadline = time.monotonic() + WAIT_SECONDS
        with self.sessions() as watcher:
            while True:
                waiting = watcher.scalar(
                    text("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = :pid AND NOT granted)"),
                    {"pid": outcome.get("pid")},
                )
                watcher.rollback()  # a fresh snapshot of pg_locks each time
                if waiting:
                    return
                assert "result" not in outcome, "a completion went through while the reaper held the row"
                assert time.monotonic() < deadline, "the completion never waited for the reaper's row lock"
                time.sleep(0.002)

    # -- invariants ----------------------------------------------------------

    @invariant()
    def table_matches_the_rules(self) -> None:
        """The table is the model's, reached by documented transitions only."""
        with self.sessions.begin() as session:
            now = self._now(session)
            rows = self._rows(session)
            stats = self.repo.stats(session)
        for job_id in set(rows) | set(self.observed):
            old, new = self.observed.get(job_id), rows.get(job_id)
            move = (old.status if old else None, new.status if new else None)
            assert move in self.legal, f"job {job_id}: illegal transition {move[0]} -> {move[1]}"
            if old is None or new is None:
                continue
            claimed = move == (PENDING, RUNNING)
            taken_back = job_id in self.handed_back and move in ((RUNNING, PENDING), (RUNNING, CANCELLED))
            expected = old.attempts + (1 if claimed else 0) - (1 if taken_back else 0)
            assert new.attempts == expected, f"job {job_id}: attempts moved {move}"
            assert (new.max_attempts is None) == (old.max_attempts is None), f"job {job_id}: max_attempts set or unset"
            if new.max_attempts is not None and old.max_attempts is not None:
                assert new.max_attempts >= old.max_attempts, f"job {job_id}: max_attempts shrank"
        for row in rows.values():
            bound = row.limit_bound(self.granted.get(row.id, 0))
            # A job cancelled while running may have used its last attempt.
            within = row.attempts < bound if row.status == PENDING else row.attempts <= bound
            assert within, f"job {row.id}: {row.attempts} attempts in {row.status} exceeds its limit"
            owned = row.status == RUNNING
            assert (row.lock_token is not None) == owned, f"job {row.id}: lock_token while {row.status}"
            assert (row.lease_expires_at is not None) == owned, f"job {row.id}: lease while {row.status}"
            # A done job keeps who ran it; any other job not running has no owner.
            assert (row.locked_by is not None) == (row.status in (RUNNING, DONE)), f"job {row.id}: locked_by"
            assert (row.finished_at is not None) == (row.status in FINISHED), f"job {row.id}: finished_at"
        if rows != self.model:
            diff = {
                i: (self.model.get(i), rows.get(i)) for i in set(rows) | set(self.model)
                if rows.get(i) != self.model.get(i)
            }
            raise AssertionError(f"table differs from the rules (job: (expected, actual)): {diff}")
        expected_stats: dict[str, tuple[int, timedelta | None]] = {}
        for row in rows.values():
            count, age = expected_stats.get(row.status, (0, None))
            if row.status == PENDING and row.run_at <= now:
                waited = now - row.run_at
                age = waited if age is None else max(age, waited)
            expected_stats[row.status] = (count + 1, age)
        assert {s.status: (s.count, s.oldest_runnable_age) for s in stats} == expected_stats
        self.observed = rows
        self.handed_back.clear()


@pytest.mark.parametrize("repository", [jobs, reports], ids=["delete_when_done", "keep_done"])
def test_job_state_machine(repository: JobRepository[Any], db_url: URL, engine: Engine) -> None:
    """Random verb sequences keep the table equal to the model of the rules.

    ``engine`` is requested so that conftest empties the shared tables afterwards.
    """
    machine_engine = create_engine(db_url, connect_args=CONNECT_ARGS, pool_size=4)
    try:

        class Machine(QueueMachine):
            repo = repository
            sessions = sessionmaker(machine_engine, expire_on_commit=False)

        run_state_machine_as_test(Machine, settings=SETTINGS)
    finally:
        machine_engine.dispose()
