"""Jobs handed back by enqueue, enqueue_many and claim are detached snapshots
equal to the stored rows, whichever path wrote them (INSERT or COPY)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from jobapp import EmailJob, TaskJob, emails, jobs
from sqlalchemy import Engine, func, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Session, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import JobSpec
from sa_jobqueue.bulk import COPY_THRESHOLD


def _columns(job: Any) -> dict[str, Any]:
    return {attr.key: getattr(job, attr.key) for attr in sa_inspect(type(job)).column_attrs}


def _assert_equal_to_rows(session: Session, snapshots: list[Any]) -> None:
    model = type(snapshots[0])
    stored = {row.id: row for row in session.scalars(select(model).where(model.id.in_([j.id for j in snapshots])))}
    assert len(stored) == len({j.id for j in snapshots})
    for job in snapshots:
        assert _columns(job) == _columns(stored[job.id])


def _specs(n: int) -> list[JobSpec]:
    at = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=5)))
    return [
        JobSpec(
            "noop", {"i": i, "tuple": (1, "a"), "nested": {"k": [None, True, 1.5]}}, queue=f"q{i % 3}",
            priority=i % 7 - 3, max_attempts=1 + i % 4,
            run_at=at if i % 5 == 0 else None, delay=timedelta(seconds=i) if i % 5 == 1 else None,
        )
        for i in range(n)
    ]


def test_bulk_enqueue_copies_and_returns_what_was_stored(sessions: sessionmaker[Session], engine: Engine) -> None:
    with recorded_sql(engine) as sent, sessions.begin() as session:
        created = jobs.enqueue_many(session, _specs(200))
    assert not [s for s in sent if s.startswith("INSERT")], "plain rows of a plain job table go through COPY"
    assert [job.payload["i"] for job in created] == list(range(200))
    assert created[0].payload["tuple"] == [1, "a"], "as read back from jsonb"
    assert [job.id for job in created] == sorted(job.id for job in created)
    with sessions() as session:
        _assert_equal_to_rows(session, created)
        now = session.scalar(select(func.now()))
        assert now is not None
        # A delayed row is due at its enqueue time plus its delay, on the database's clock.
        assert created[1].run_at == created[1].created_at + timedelta(seconds=1)


def test_bulk_enqueue_rolls_back_with_the_callers_transaction(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        session.begin()
        jobs.enqueue_many(session, _specs(COPY_THRESHOLD * 4))
        session.rollback()
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0
    with sessions.begin() as session:
        jobs.enqueue_many(session, _specs(COPY_THRESHOLD * 4))
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == COPY_THRESHOLD * 4


def test_insert_paths_return_what_was_stored(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        few = jobs.enqueue_many(session, _specs(COPY_THRESHOLD - 1))  # under the COPY threshold
        own_column = emails.enqueue_many(
            session, [JobSpec("noop", {"i": i}, extra={"tenant_id": i}) for i in range(50)]
        )
        one = jobs.enqueue(session, "noop", {"x": 1}, delay=30)
        deduped = jobs.enqueue_many(session, [JobSpec("noop", dedupe_key=f"k{i % 10}") for i in range(40)])
    assert [job.tenant_id for job in own_column] == list(range(50))
    with sessions() as session:
        for created in (few, own_column, [one], deduped):
            _assert_equal_to_rows(session, created)


def test_snapshots_are_detached_and_outlive_their_session(sessions: sessionmaker[Session], engine: Engine) -> None:
    with Session(engine) as session, session.begin():  # expire_on_commit=True, the default
        job = jobs.enqueue(session, "noop", {"a": 1})
        bulk = jobs.enqueue_many(session, _specs(40))
    state = sa_inspect(job)
    assert state.detached and state.identity == (job.id,)
    # The session committed and closed: reading emits no SQL and raises nothing.
    with recorded_sql(engine) as sent:
        assert (job.payload, job.status, bulk[-1].payload["i"]) == ({"a": 1}, "pending", 39)
    assert sent == []
    with sessions.begin() as session:
        claimed = jobs.claim(session, limit=100)
        assert all(sa_inspect(j).detached for j in claimed)
        _assert_equal_to_rows(session, claimed)
        # A snapshot can join a session, and reloads the row from there.
        attached = session.merge(claimed[0])
        assert attached.status == "running"
    with sessions() as session:
        reloaded = session.get(EmailJob, 10**12)
        assert reloaded is None
