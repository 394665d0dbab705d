"""JobRepository verbs against a real PostgreSQL, in one process."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from jobapp import EmailJob, Ledger, ReportJob, TaskJob, User, emails, jobs, reports, tasks
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session, scoped_session, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import InvalidArgumentError, JobLostError, JobSpec, LeaseReport, ReapResult, RetryPolicy
from sa_jobqueue.statements import claim as claim_statement
from sa_jobqueue.testing import run_jobs

LEASE = timedelta(seconds=60)


def _count(session: Session, model: type, **where: object) -> int:
    stmt = select(func.count()).select_from(model)
    for key, value in where.items():
        stmt = stmt.where(getattr(model, key) == value)
    return int(session.scalar(stmt) or 0)


def _expire(sessions: sessionmaker[Session], jobs_: Iterable[Any]) -> None:
    """The workers holding these claimed jobs stalled: their leases now lie in
    the past, set by the database rather than waited for."""
    ids = [job.id for job in jobs_]
    with sessions.begin() as session:
        session.execute(
            update(TaskJob).where(TaskJob.id.in_(ids), TaskJob.status == "running")
            .values(lease_expires_at=TaskJob.locked_at - timedelta(seconds=1))
        )


# -- enqueue ----------------------------------------------------------------


def test_enqueue_returns_the_users_model(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        job = emails.enqueue(session, "send_welcome", {"user_id": 42}, queue="signup", extra={"tenant_id": 7})
    assert isinstance(job, EmailJob)
    assert (job.task, job.queue, job.payload, job.status, job.tenant_id) == (
        "send_welcome", "signup", {"user_id": 42}, "pending", 7
    )
    assert job.attempts == 0 and job.max_attempts is None and job.priority == 0  # None: the task's limit, else 20


def test_outbox_job_exists_iff_the_callers_transaction_commits(sessions: sessionmaker[Session]) -> None:
    with pytest.raises(RuntimeError):
        with sessions.begin() as session:
            session.add(User(name="ada"))
            emails.enqueue(session, "send_welcome", {"user_id": 1})
            raise RuntimeError("the app's transaction fails")
    with sessions() as session:
        assert _count(session, EmailJob) == 0 and _count(session, User) == 0
    with sessions.begin() as session:
        session.add(User(name="ada"))
        emails.enqueue(session, "send_welcome", {"user_id": 1})
    with sessions() as session:
        assert _count(session, EmailJob) == 1 and _count(session, User) == 1


def test_enqueue_does_not_commit_for_the_caller(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        session.begin()
        jobs.enqueue(session, "noop")
        jobs.enqueue_many(session, [JobSpec("noop"), JobSpec("noop", dedupe_key="k")])
        with sessions() as other:
            assert _count(other, TaskJob) == 0
        session.rollback()
    with sessions() as session:
        assert _count(session, TaskJob) == 0


def test_enqueue_many_in_order_one_statement(sessions: sessionmaker[Session], engine) -> None:  # type: ignore[no-untyped-def]
    # EmailJob has a column of the app's own, so its rows take the INSERT path
    # (plain job tables take COPY: tests/test_snapshots.py).
    with recorded_sql(engine) as statements, sessions.begin() as session:
        created = emails.enqueue_many(session, [JobSpec("noop", {"i": i}) for i in range(500)])
    assert [job.payload["i"] for job in created] == list(range(500))
    assert len({job.id for job in created}) == 500
    assert len([s for s in statements if s.startswith("INSERT")]) == 1


def test_dedupe_returns_the_live_job(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", {"v": 1}, dedupe_key="report:7")
        again = jobs.enqueue(session, "noop", {"v": 2}, dedupe_key="report:7")
        other_queue = jobs.enqueue(session, "noop", dedupe_key="report:7", queue="other")
    assert again.id == first.id and again.payload == {"v": 1}
    assert other_queue.id != first.id
    with sessions.begin() as session:
        bulk = jobs.enqueue_many(session, [
            JobSpec("noop", dedupe_key="report:7"), JobSpec("noop", dedupe_key="new"),
            JobSpec("noop", dedupe_key="new"), JobSpec("noop"),
        ])
    assert bulk[0].id == first.id and bulk[1].id == bulk[2].id and bulk[3].id not in {first.id, bulk[1].id}
    with sessions() as session:
        assert _count(session, TaskJob) == 4


def test_dedupe_key_is_free_again_once_the_job_finished(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", dedupe_key="k")
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
        jobs.complete(session, claimed)
    with sessions.begin() as session:
        second = jobs.enqueue(session, "noop", dedupe_key="k")
    assert second.id != first.id
    # A cancelled job does not hold its key either.
    with sessions.begin() as session:
        assert jobs.cancel(session, second.id)
        third = jobs.enqueue(session, "noop", dedupe_key="k")
    assert third.id != second.id


# -- bad input --------------------------------------------------------------


class NotJson:
    pass


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"payload": {"x": NotJson()}}, "payload"),
        ({"payload": {"x": math.nan}}, "payload"),
        ({"payload": [math.inf]}, "payload"),
        ({"task": ""}, "task"),
        ({"task": "   "}, "task"),
        ({"task": "t" * 129}, "task"),
        ({"queue": ""}, "queue"),
        ({"queue": "q" * 129}, "queue"),
        ({"priority": 40000}, "priority"),
        ({"priority": -40000}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"run_at": datetime(2030, 1, 1)}, "run_at"),
        ({"delay": timedelta(seconds=-1)}, "delay"),
        ({"delay": -5}, "delay"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": -3}, "max_attempts"),
        ({"dedupe_key": ""}, "dedupe_key"),
        ({"dedupe_key": "k" * 256}, "dedupe_key"),
        ({"extra": {"no_such_column": 1}}, "extra"),
        ({"run_at": datetime(2030, 1, 1, tzinfo=timezone.utc), "delay": 5}, "run_at"),
    ],
)
def test_bad_input_is_a_typed_error_naming_the_parameter_and_writes_nothing(
    sessions: sessionmaker[Session], kwargs: dict[str, object], parameter: str
) -> None:
    args = {"task": "noop", "payload": {"ok": True}} | kwargs
    with sessions() as session, session.begin():
        jobs.enqueue(session, "noop", {"before": True})
        with pytest.raises(InvalidArgumentError) as info:
            jobs.enqueue(session, args.pop("task"), args.pop("payload"), **args)  # type: ignore[arg-type]
        assert info.value.parameter == parameter
        assert parameter in str(info.value)
        # Nothing was sent: the transaction is healthy and holds only the first job.
        assert _count(session, TaskJob) == 1
    with sessions.begin() as session:
        with pytest.raises(InvalidArgumentError):
            # In bulk too: the good spec before the bad one is not inserted either.
            spec = JobSpec(**({"task": "noop", "payload": {"ok": True}} | kwargs))  # type: ignore[arg-type]
            jobs.enqueue_many(session, [JobSpec("noop"), spec])
    with sessions() as session:
        assert _count(session, TaskJob) == 1


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [({"limit": 0}, "limit"), ({"queues": []}, "queues"), ({"queues": [""]}, "queues"),
     ({"lease": timedelta(0)}, "lease")],
)
def test_bad_claim_arguments(sessions: sessionmaker[Session], kwargs: dict[str, object], parameter: str) -> None:
    with sessions.begin() as session:
        with pytest.raises(InvalidArgumentError) as info:
            jobs.claim(session, **kwargs)  # type: ignore[arg-type]
        assert info.value.parameter == parameter


# -- claim ------------------------------------------------------------------


def test_claim_order_priority_then_run_at(sessions: sessionmaker[Session]) -> None:
    now = datetime.now(timezone.utc)
    with sessions.begin() as session:
        late = jobs.enqueue(session, "noop", {"n": "late"}, run_at=now - timedelta(seconds=1))
        early = jobs.enqueue(session, "noop", {"n": "early"}, run_at=now - timedelta(seconds=10))
        urgent = jobs.enqueue(session, "noop", {"n": "urgent"}, priority=-5)
        lazy = jobs.enqueue(session, "noop", {"n": "lazy"}, priority=5, run_at=now - timedelta(hours=1))
    with sessions.begin() as session:
        claimed = jobs.claim(session, limit=10, lease=LEASE)
    assert [j.id for j in claimed] == [urgent.id, early.id, late.id, lazy.id]
    assert all(j.status == "running" and j.attempts == 1 and j.lock_token for j in claimed)


def test_future_jobs_are_not_claimable(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        later = jobs.enqueue(session, "noop", delay=timedelta(hours=1))
        jobs.enqueue(session, "noop", run_at=datetime.now(timezone.utc) + timedelta(minutes=5))
        now = jobs.enqueue(session, "noop")
    # A delay is added to the database's now(), the clock the claim compares with.
    assert later.run_at == later.created_at + timedelta(hours=1) and now.run_at == now.created_at
    with sessions.begin() as session:
        assert [j.id for j in jobs.claim(session, limit=10)] == [now.id]
    # Once the database's clock has reached a job's run_at (set to it, not waited for), it is claimable.
    with sessions.begin() as session:
        session.execute(update(TaskJob).where(TaskJob.id == later.id).values(run_at=func.now()))
    with sessions.begin() as session:
        assert [j.id for j in jobs.claim(session, limit=10)] == [later.id]


def test_claim_filters_queues(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        a = jobs.enqueue(session, "noop", queue="a")
        b = jobs.enqueue(session, "noop", queue="b")
        jobs.enqueue(session, "noop", queue="c")
    with sessions.begin() as session:
        assert [j.id for j in jobs.claim(session, queues="a", limit=5)] == [a.id]
    with sessions.begin() as session:
        # b and c tie on priority and run_at (one transaction's now()): the lower id goes first.
        assert [j.id for j in jobs.claim(session, queues=["b", "c"], limit=1)] == [b.id]
        assert session.scalars(select(TaskJob.queue).where(TaskJob.status == "pending")).all() == ["c"]


def test_claim_respects_the_limit_and_skips_locked_rows(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop") for _ in range(10)])
    holder = sessions()
    holder.begin()
    held = jobs.claim(holder, limit=3)  # uncommitted: rows stay locked
    with sessions.begin() as session:
        other = jobs.claim(session, limit=4)
    assert len(held) == 3 and len(other) == 4
    assert not {j.id for j in held} & {j.id for j in other}
    holder.rollback()
    holder.close()
    with sessions() as session:
        assert _count(session, TaskJob, status="pending") == 6


def test_claim_statement_locks_in_a_cte_evaluated_once(engine) -> None:  # type: ignore[no-untyped-def]
    stmt = claim_statement(TaskJob)
    compiled = stmt.compile(engine)
    sql = str(compiled)
    assert sql.lstrip().startswith("WITH picked AS")
    assert "FOR UPDATE SKIP LOCKED" in sql and " IN (SELECT" not in sql
    params = compiled.params | {"queue_0": "a", "limit": 5, "worker": "w", "lease": LEASE}
    with engine.begin() as conn:
        # On a tiny table the planner may rightly prefer a seq scan or a
        # bitmap scan and a sort; with those priced out, the plan shows that
        # the claim index serves the priority walk and each priority's locking
        # scan in order (tests/test_claim_scale.py counts what they read on a
        # big table, where the planner picks these by itself).
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        conn.exec_driver_sql("SET LOCAL enable_bitmapscan = off")
        plan = "\n".join(row[0] for row in conn.exec_driver_sql("EXPLAIN " + sql, params))
    assert "CTE picked" in plan and "LockRows" in plan and "Recursive Union" in plan
    assert "Index Only Scan using ix_task_jobs_claim_v2" in plan, plan
    assert "Index Scan using ix_task_jobs_claim_v2" in plan and "AND (run_at <= now()))" in plan, plan


# -- finishing, fencing -----------------------------------------------------


def test_complete_deletes_or_keeps_done(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue(session, "noop")
        reports.enqueue(session, "noop")
    with sessions.begin() as session:
        [job] = jobs.claim(session)
        [report] = reports.claim(session)
        jobs.complete(session, job)
        reports.complete(session, report)
    with sessions() as session:
        assert _count(session, TaskJob) == 0
        kept = session.scalars(select(ReportJob)).one()
        assert kept.status == "done" and kept.finished_at is not None and kept.attempts == 1


def test_fail_backs_off_then_dead_keeping_last_error(sessions: sessionmaker[Session]) -> None:
    policy = RetryPolicy(base=timedelta(seconds=30), jitter=0)
    with sessions.begin() as session:
        job = jobs.enqueue(session, "noop", max_attempts=2)
    with sessions.begin() as session:
        [claimed] = jobs.claim(session)
        assert jobs.fail(session, claimed, "first error", policy=policy) == "pending"
        row = session.get(TaskJob, job.id, populate_existing=True)
        assert row is not None
        wait = (row.run_at - session.scalar(select(func.now()))).total_seconds()
        assert 29 <= wait <= 31 and row.last_error == "first error" and row.lock_token is None
    with sessions.begin() as session:
        session.execute(text("UPDATE task_jobs SET run_at = now()"))
        [claimed] = jobs.claim(session)
        assert claimed.attempts == 2
        assert jobs.fail(session, claimed, "second error", policy=policy) == "dead"
    with sessions() as session:
        row = session.get(TaskJob, job.id)
        assert row is not None and row.status == "dead" and row.last_error == "second error"
        assert row.finished_at is not None


def test_retry_policy_grows_exponentially_with_jitter() -> None:
    policy = RetryPolicy(base=timedelta(seconds=10), factor=2, max_delay=timedelta(seconds=100), jitter=0.1)
    for attempt, expected in [(1, 10), (2, 20), (3, 40), (4, 80), (5, 100), (60, 100), (10**6, 100)]:
        seconds = policy.delay(attempt).total_seconds()
        assert expected * 0.9 <= seconds <= expected * 1.1
    assert len({policy.delay(3) for _ in range(20)}) > 1
    with pytest.raises(InvalidArgumentError):
        RetryPolicy(jitter=1.5)


def test_a_stale_worker_cannot_complete_or_fail_a_reclaimed_job(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "noop")
    with sessions.begin() as session:
        [stale] = jobs.claim(session, worker="stale", lease=LEASE)
    _expire(sessions, [stale])
    with sessions.begin() as session:
        assert jobs.reap(session).requeued == 1
    with sessions.begin() as session:
        [fresh] = jobs.claim(session, worker="fresh", lease=LEASE)
    assert fresh.id == stale.id and fresh.lock_token != stale.lock_token and fresh.attempts == 2
    with sessions() as session, session.begin():
        session.add(Ledger(job_id=job.id, note="stale"))
        with pytest.raises(JobLostError, match=str(job.id)):
            jobs.complete(session, stale)
        session.rollback()
    with sessions.begin() as session:
        with pytest.raises(JobLostError):
            jobs.fail(session, stale, "stale failure")
        assert jobs.heartbeat(session, [stale, fresh], lease=LEASE) == {fresh.id}
    with sessions() as session:
        row = session.get(TaskJob, job.id)
        # The reap's error stays: the stale failure was not recorded.
        assert row is not None and (row.status, row.locked_by, row.last_error) == (
            "running", "fresh", "lease expired at attempt 1 (worker stale)"
        )
        assert _count(session, Ledger) == 0
    with sessions.begin() as session:
        jobs.complete(session, fresh)
    with sessions() as session:
        assert _count(session, TaskJob) == 0


def test_complete_many_is_fenced_per_job(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop") for _ in range(3)])
        reports.enqueue_many(session, [JobSpec("noop") for _ in range(2)])
    with sessions.begin() as session:
        expiring = jobs.claim(session, limit=2, lease=LEASE)
        [kept] = jobs.claim(session, limit=1, lease=LEASE)
        done_reports = reports.claim(session, limit=2)
    _expire(sessions, expiring)
    with sessions.begin() as session:
        assert jobs.reap(session).requeued == 2
        assert jobs.complete_many(session, [*expiring, kept]) == {kept.id}
        assert reports.complete_many(session, done_reports) == {j.id for j in done_reports}
        assert jobs.complete_many(session, []) == set()
    with sessions() as session:
        assert _count(session, TaskJob, status="pending") == 2 and _count(session, TaskJob) == 2
        assert _count(session, ReportJob, status="done") == 2


# -- reap, cancel, retry, stats, purge -------------------------------------


def test_reap_requeues_or_kills_expired_leases_only(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue(session, "noop", {"n": 1})
        jobs.enqueue(session, "noop", {"n": 2}, max_attempts=1)
        jobs.enqueue(session, "noop", {"n": 3})
    with sessions.begin() as session:
        short = jobs.claim(session, limit=2, lease=LEASE)
        [long] = jobs.claim(session, limit=1, lease=LEASE)
    _expire(sessions, short)
    with sessions.begin() as session:
        result = jobs.reap(session)
    assert (result.requeued, result.dead) == (1, 1)
    with sessions() as session:
        by_n = {j.payload["n"]: j for j in session.scalars(select(TaskJob))}
    assert by_n[1].status == "pending" and "lease expired" in (by_n[1].last_error or "")
    # Back in its old place in the queue, not behind jobs enqueued since.
    assert by_n[1].run_at == next(j.run_at for j in short if j.id == by_n[1].id)
    assert by_n[2].status == "dead" and by_n[2].attempts == 1
    assert by_n[3].status == "running" and long.id == by_n[3].id and len(short) == 2
    with sessions.begin() as session:
        assert jobs.reap(session).requeued == 0


def test_concurrent_reapers_reap_each_job_once(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop") for _ in range(6)])
    with sessions.begin() as session:
        claimed = jobs.claim(session, limit=6, lease=LEASE)
    _expire(sessions, claimed)
    first = sessions()
    first.begin()
    taken = jobs.reap(first, limit=4)  # uncommitted: these rows stay locked
    with sessions.begin() as second:
        rest = jobs.reap(second)
    first.commit()
    first.close()
    assert (taken.requeued, rest.requeued) == (4, 2)
    with sessions() as session:
        assert _count(session, TaskJob, status="pending") == 6


def test_reap_applies_a_tasks_own_max_attempts(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        strict = jobs.enqueue(session, "strict")
        lenient = jobs.enqueue(session, "lenient")
    with sessions.begin() as session:
        claimed = jobs.claim(session, limit=2, lease=LEASE)
    _expire(sessions, claimed)
    with sessions.begin() as session:
        with pytest.raises(InvalidArgumentError):
            jobs.reap(session, task_max_attempts={"strict": 0})
    with sessions.begin() as session:
        assert jobs.reap(session, task_max_attempts={"strict": 1}) == ReapResult(requeued=1, dead=1)
    with sessions() as session:
        assert session.get(TaskJob, strict.id).status == "dead"  # type: ignore[union-attr]
        assert session.get(TaskJob, lenient.id).status == "pending"  # type: ignore[union-attr]


def test_cancel_pending_at_once_running_by_request_and_retry(sessions: sessionmaker[Session]) -> None:
    """A pending job is cancelled at once; a running one stays running with the
    request recorded (cancel returns True for both), until it leaves running:
    a failure, a hand-back or a reap then ends it cancelled, a completion still
    completes it. retry() clears the request."""
    with sessions.begin() as session:
        pending = jobs.enqueue(session, "noop")
        running = jobs.enqueue(session, "noop", priority=-2)
        completing = jobs.enqueue(session, "noop", priority=-1)
    with sessions.begin() as session:
        claimed, finishing = jobs.claim(session, limit=2)
    assert (claimed.id, finishing.id) == (running.id, completing.id)
    with sessions.begin() as session:
        assert jobs.cancel(session, pending.id) is True
        assert jobs.cancel(session, running.id) is True
        assert jobs.cancel(session, completing.id) is True
        assert jobs.cancel(session, 10**12) is False
    with sessions() as session:
        cancelled, requested = session.get(TaskJob, pending.id), session.get(TaskJob, running.id)
        assert cancelled is not None and requested is not None
        assert (cancelled.status, cancelled.finished_at is not None) == ("cancelled", True)
        assert (requested.status, requested.lock_token) == ("running", claimed.lock_token)
        first_request = requested.cancel_requested_at
        assert first_request is not None
    with sessions.begin() as session:
        assert jobs.cancel(session, running.id) is True  # asked again: the first request's time is kept
        assert jobs.cancel(session, pending.id) is False  # already cancelled
        report = jobs.extend_leases(session, [claimed, finishing], lease=LEASE)
        assert report == LeaseReport(owned={running.id, completing.id}, cancel_requested={running.id, completing.id})
        # The request is the worker's to honour: a completion still completes the job...
        jobs.complete(session, finishing)
        # ... while a failure ends it cancelled, neither retried nor dead.
        assert jobs.fail(session, claimed, "boom") == "cancelled"
    with sessions() as session:
        assert session.get(TaskJob, completing.id) is None
        row = session.get(TaskJob, running.id)
        assert row is not None
        assert (row.status, row.cancel_requested_at, row.last_error, row.lock_token) == (
            "cancelled", first_request, "boom", None
        )
    with sessions.begin() as session:
        assert jobs.cancel(session, running.id) is False  # finished
        assert jobs.retry(session, running.id) is True
        assert jobs.retry(session, running.id) is False  # pending now
    with sessions.begin() as session:
        [again] = jobs.claim(session)
        assert (again.id, again.attempts, again.cancel_requested_at) == (running.id, 2, None)


def test_retry_does_not_duplicate_a_dedupe_key_held_by_a_live_job(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        cancelled = jobs.enqueue(session, "noop", dedupe_key="nightly")
        assert jobs.cancel(session, cancelled.id)
        live = jobs.enqueue(session, "noop", dedupe_key="nightly")
        assert live.id != cancelled.id
        assert jobs.retry(session, cancelled.id) is False
        assert jobs.cancel(session, live.id)
        assert jobs.retry(session, cancelled.id) is True


def test_stats_per_queue_and_status_with_oldest_runnable_age(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue(session, "noop", queue="a", run_at=datetime.now(timezone.utc) - timedelta(minutes=5))
        jobs.enqueue(session, "noop", queue="a")
        jobs.enqueue(session, "noop", queue="a", delay=3600)
        jobs.enqueue(session, "noop", queue="b")
    with sessions.begin() as session:
        jobs.claim(session, queues="b")
    with sessions() as session:
        stats = {(s.queue, s.status): s for s in jobs.stats(session)}
    assert stats[("a", "pending")].count == 3 and stats[("b", "running")].count == 1
    age = stats[("a", "pending")].oldest_runnable_age
    assert age is not None and timedelta(minutes=4) < age < timedelta(minutes=6)
    assert stats[("b", "running")].oldest_runnable_age is None


def test_purge_deletes_finished_jobs_in_bounded_batches(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        reports.enqueue_many(session, [JobSpec("noop") for _ in range(5)])
        keep = reports.enqueue(session, "noop", priority=10)
    with sessions.begin() as session:
        for job in reports.claim(session, limit=5):
            reports.complete(session, job)
    with sessions.begin() as session:
        assert reports.purge(session, limit=3) == 3
        assert reports.purge(session, limit=3) == 2
        assert reports.purge(session, limit=3) == 0
        with pytest.raises(InvalidArgumentError):
            reports.purge(session, statuses=["pending"])
    with sessions() as session:
        assert [j.id for j in session.scalars(select(ReportJob))] == [keep.id]


def test_run_jobs_helper_runs_handlers_inline(engine, sessions: sessionmaker[Session]) -> None:  # type: ignore[no-untyped-def]
    with sessions.begin() as session:
        created = jobs.enqueue_many(session, [JobSpec("ledger") for _ in range(5)])
    result = run_jobs(engine, jobs, tasks)
    assert result.completed == 5
    with sessions() as session:
        assert sorted(session.scalars(select(Ledger.job_id))) == sorted(j.id for j in created)


def test_the_verbs_take_a_scoped_session(sessions: sessionmaker[Session]) -> None:
    """A scoped_session (Flask-SQLAlchemy's db.session) is the Session it proxies, for every
    verb: enqueue once failed on it, the proxy lacking get_transaction."""
    scoped = scoped_session(sessions)
    try:
        one = jobs.enqueue(scoped, "ledger", {"n": 1})
        many = jobs.enqueue_many(scoped, [JobSpec("ledger", {"n": 2}), JobSpec("ledger", {"n": 3})])
        claimed = jobs.claim(scoped, limit=3)
        scoped.commit()
    finally:
        scoped.remove()
    assert sorted(j.id for j in claimed) == sorted([one.id, *(j.id for j in many)])
    with sessions() as session:
        assert _count(session, TaskJob, status="running") == 3
