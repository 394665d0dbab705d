"""enqueue_many_fast: enqueue_many's rows, checks, NOTIFY and transaction, with
a count of the new jobs instead of the jobs: plain rows go through COPY with
nothing reserved or read back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from jobapp import EmailJob, TaskJob, emails, jobs
from sqlalchemy import DateTime, Engine, Integer, SmallInteger, create_engine, func, select, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqllog import recorded_sql
from test_docs import DOCS, python_blocks, section

from sa_jobqueue import InvalidArgumentError, JobMixin, JobRepository, JobSpec
from sa_jobqueue.bulk import COPY_THRESHOLD, omissible
from sa_jobqueue.enqueue_hooks import Enqueueing, add_enqueue_hook, remove_enqueue_hook


def _specs(n: int, *, meta: bool = False) -> list[JobSpec]:
    at = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=5)))
    return [
        JobSpec(
            "noop", {"i": i, "tuple": (1, "a"), "text": "é\\u0000 \t\n\\"}, queue=f"q{i % 3}",
            priority=i % 7 - 3, max_attempts=None if i % 3 == 0 else i % 4 + 1,
            run_at=at if i % 5 == 0 else None, delay=timedelta(seconds=i) if i % 5 == 1 else None,
            meta={"m": i} if meta else None,
        )
        for i in range(n)
    ]


def _rows(session: Session, model: Any) -> list[dict[str, Any]]:
    """Every stored row of ``model``, by id, as a mapping of column to value."""
    keys = [attr.key for attr in sa_inspect(model).column_attrs]
    return [{key: getattr(job, key) for key in keys} for job in session.scalars(select(model).order_by(model.id))]


def _count(sessions: sessionmaker[Session], model: Any) -> int:
    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


@pytest.mark.parametrize("meta", [False, True], ids=["plain", "with-meta"])
def test_it_stores_what_enqueue_many_stores_through_copy_alone(
    sessions: sessionmaker[Session], engine: Engine, meta: bool
) -> None:
    """Every column equals what enqueue_many stores for the same specs in the same
    transaction (the id aside), the ids follow the specs' order, and the only statements
    are the SAVEPOINT around the COPY, the transaction's now() and the NOTIFY: no INSERT,
    no id reservation."""
    specs = _specs(COPY_THRESHOLD * 3, meta=meta)
    with sessions.begin() as session:
        with recorded_sql(engine) as sent:
            assert jobs.enqueue_many_fast(session, specs) == len(specs)
        returned = jobs.enqueue_many(session, specs)
    assert [s.split()[0] for s in sent] == ["SAVEPOINT", "SELECT", "RELEASE", "SELECT"], sent
    assert sent[1] == "SELECT now()" and "pg_notify" in sent[3], sent
    with sessions() as session:
        rows = _rows(session, TaskJob)
    by_fast, by_many = rows[:len(specs)], rows[len(specs):]
    assert [row["id"] for row in by_many] == [job.id for job in returned]
    assert [row["payload"]["i"] for row in by_fast] == list(range(len(specs))), "ids in the specs' order"
    for a, b in zip(by_many, by_fast, strict=True):
        assert {k: v for k, v in a.items() if k != "id"} == {k: v for k, v in b.items() if k != "id"}
    assert by_fast[1]["run_at"] == by_fast[1]["created_at"] + timedelta(seconds=1), "delay on the database's clock"
    assert by_fast[0]["payload"]["text"] == "é\\u0000 \t\n\\", "COPY's escapes round-trip"


def test_rows_that_all_have_a_run_at_need_no_round_trip_before_the_copy(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    at = datetime(2031, 5, 6, tzinfo=timezone.utc)
    with recorded_sql(engine) as sent, sessions.begin() as session:
        assert jobs.enqueue_many_fast(session, [JobSpec("noop", {"i": i}, run_at=at)
                                                for i in range(COPY_THRESHOLD)]) == COPY_THRESHOLD
    assert [s.split()[0] for s in sent] == ["SAVEPOINT", "RELEASE"], "a future run_at notifies nothing, " \
        "and COPY is not a cursor execute"
    with sessions() as session:
        assert {row["run_at"] for row in _rows(session, TaskJob)} == {at}


def test_rows_at_the_defaults_leave_them_to_the_table(sessions: sessionmaker[Session], engine: Engine) -> None:
    """Rows that all keep priority 0, no run_at and no limit are copied without those columns
    (and without the round trip for now()): the table's defaults store what enqueue_many stores."""
    specs = [JobSpec("noop", {"i": i}) for i in range(COPY_THRESHOLD)]
    with sessions.begin() as session:
        with recorded_sql(engine) as sent:
            jobs.enqueue_many_fast(session, specs)
        jobs.enqueue_many(session, specs)
    assert [s.split()[0] for s in sent] == ["SAVEPOINT", "RELEASE", "SELECT"] and "pg_notify" in sent[2], sent
    with sessions() as session:
        rows = _rows(session, TaskJob)
    assert {(row["priority"], row["run_at"] == row["created_at"], row["max_attempts"]) for row in rows} == {
        (0, True, None)}


class OwnDefaultsBase(DeclarativeBase):
    pass


class LateJob(JobMixin, OwnDefaultsBase):
    """Defaults of its own for the columns a COPY of default rows leaves out: they are sent."""

    __tablename__ = "late_jobs"
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("5"))
    run_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=text("now() + interval '1 day'"))
    max_attempts: Mapped[int | None] = mapped_column(Integer, server_default=text("3"))


def test_columns_with_defaults_of_their_own_are_sent(create_database: Callable[[], URL]) -> None:
    assert omissible(TaskJob.__table__) == {"priority", "run_at", "max_attempts"}
    assert omissible(LateJob.__table__) == set()
    engine = create_engine(create_database())
    try:
        OwnDefaultsBase.metadata.create_all(engine)
        late = JobRepository(LateJob)
        with Session(engine) as session, session.begin():
            assert late.enqueue_many_fast(session, [JobSpec("noop", {"i": i}) for i in range(COPY_THRESHOLD)]) == 16
            many = late.enqueue_many(session, [JobSpec("noop", {"i": i}) for i in range(COPY_THRESHOLD)])
        with Session(engine) as session:
            rows = _rows(session, LateJob)
        assert {(row["priority"], row["run_at"], row["max_attempts"]) for row in rows} == {
            (0, many[0].created_at, None)}, "what enqueue_many stores, not the table's own defaults"
    finally:
        engine.dispose()


def test_it_counts_new_jobs_only(sessions: sessionmaker[Session]) -> None:
    """A spec whose dedupe key a live job (or an earlier spec) holds makes no job."""
    keyed = [JobSpec("noop", {"i": i}, dedupe_key=f"k{i % 10}") for i in range(40)]
    plain = [JobSpec("noop", {"i": i}) for i in range(COPY_THRESHOLD + 4)]
    with sessions.begin() as session:
        assert jobs.enqueue_many_fast(session, keyed + plain) == 10 + len(plain)
    with sessions.begin() as session:
        assert jobs.enqueue_many_fast(session, keyed) == 0
        assert jobs.enqueue_many_fast(session, []) == 0
    assert _count(sessions, TaskJob) == 10 + len(plain)


def test_the_insert_paths_count_too(sessions: sessionmaker[Session], engine: Engine) -> None:
    """Under the COPY threshold, and on a table with columns of the application's own, the rows
    take enqueue_many's INSERT."""
    with recorded_sql(engine) as sent, sessions.begin() as session:
        assert jobs.enqueue_many_fast(session, _specs(COPY_THRESHOLD - 1)) == COPY_THRESHOLD - 1
        own = [JobSpec("noop", {"i": i}, extra={"tenant_id": i}) for i in range(COPY_THRESHOLD * 2)]
        assert emails.enqueue_many_fast(session, own) == len(own)
    assert len([s for s in sent if s.startswith("INSERT")]) == 2
    with sessions() as session:
        assert [row["tenant_id"] for row in _rows(session, EmailJob)] == list(range(COPY_THRESHOLD * 2))


def test_it_commits_and_rolls_back_with_the_callers_transaction(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        session.begin()
        jobs.enqueue_many_fast(session, _specs(COPY_THRESHOLD * 2))
        session.rollback()
    assert _count(sessions, TaskJob) == 0
    with sessions.begin() as session:
        jobs.enqueue_many_fast(session, _specs(COPY_THRESHOLD * 2))
    assert _count(sessions, TaskJob) == COPY_THRESHOLD * 2


@pytest.mark.parametrize("at", [0, COPY_THRESHOLD, 20_000], ids=["first", "early", "after-20000-rows"])
def test_a_bad_spec_writes_nothing_and_leaves_the_transaction_usable(sessions: sessionmaker[Session],
                                                                      at: int) -> None:
    """Specs are checked as they stream into the COPY: a refused one (the first, or one after
    thousands of rows already sent) rolls the COPY back to its SAVEPOINT; the caller's writes
    before and after it commit, and nothing of the call does."""
    good = [JobSpec("noop", {"i": i}) for i in range(max(at, COPY_THRESHOLD))]
    specs = [*good[:at], JobSpec("noop", {"bad": float("nan")}), *good[at:]]
    with sessions.begin() as session:
        jobs.enqueue(session, "noop", {"before": True})
        with pytest.raises(InvalidArgumentError, match="payload"):
            jobs.enqueue_many_fast(session, specs)
        with pytest.raises(InvalidArgumentError, match="priority"):
            jobs.enqueue_many_fast(session, [*good, JobSpec("noop", priority=2**20)])
        with pytest.raises(InvalidArgumentError, match="jobs"):
            jobs.enqueue_many_fast(session, [*good, {"task": "noop"}])  # type: ignore[list-item]
        jobs.enqueue(session, "noop", {"after": True})
    with sessions() as session:
        assert [row["payload"] for row in _rows(session, TaskJob)] == [{"before": True}, {"after": True}]


@contextmanager
def _hook() -> Iterator[list[Enqueueing]]:
    seen: list[Enqueueing] = []

    @contextmanager
    def record(enqueueing: Enqueueing) -> Iterator[None]:
        enqueueing.meta["hooked"] = True
        yield
        seen.append(enqueueing)

    add_enqueue_hook(record)
    try:
        yield seen
    finally:
        remove_enqueue_hook(record)


def test_enqueue_hooks_are_given_the_jobs_as_written(sessions: sessionmaker[Session]) -> None:
    with _hook() as seen, sessions.begin() as session:
        assert jobs.enqueue_many_fast(session, _specs(COPY_THRESHOLD * 2)) == COPY_THRESHOLD * 2
    [enqueueing] = seen
    with sessions() as session:
        rows = _rows(session, TaskJob)
    assert [job.id for job in enqueueing.jobs] == [row["id"] for row in rows]
    assert all(row["meta"] == {"hooked": True} for row in rows)


def test_runnable_rows_wake_their_queues_at_commit(sessions: sessionmaker[Session], libpq_url: str) -> None:
    listener = psycopg.connect(libpq_url, autocommit=True)
    try:
        listener.execute(f'LISTEN "{jobs.channel}"')
        later = datetime.now(timezone.utc) + timedelta(hours=1)
        with sessions.begin() as session:
            jobs.enqueue_many_fast(session, [JobSpec("noop", queue="soon" if i % 2 else "later",
                                                     run_at=None if i % 2 else later)
                                             for i in range(COPY_THRESHOLD * 2)])
        heard = [n.payload for n in listener.notifies(timeout=30, stop_after=1)]
        heard += [n.payload for n in listener.notifies(timeout=0.5)]  # one statement notifies every queue at once
        assert heard == ["soon"], "a queue of jobs due later is not woken"
    finally:
        listener.close()


def test_the_concepts_pages_example(engine: Engine, sessions: sessionmaker[Session]) -> None:
    (block,) = python_blocks(section(DOCS / "concepts.md", "## What the verbs hand back: snapshots"))
    namespace: dict[str, Any] = {"Session": Session, "engine": engine, "emails": jobs, "JobSpec": JobSpec,
                                 "ids": range(COPY_THRESHOLD * 2)}
    exec(compile(block, "docs/concepts.md", "exec"), namespace)
    with sessions() as session:
        assert sorted(row["payload"]["image"] for row in _rows(session, TaskJob)) == list(range(COPY_THRESHOLD * 2))
