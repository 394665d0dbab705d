"""The library's own statements sent through psycopg's cursor (sa_jobqueue/direct.py):
in the session's transaction, as SQLAlchemy would send them where anything could tell."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from jobapp import Ledger, TaskJob, jobs, reports
from sqlalchemy import (
    ARRAY,
    BigInteger,
    Engine,
    Integer,
    String,
    Uuid,
    bindparam,
    create_engine,
    event,
    func,
    insert,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from waiting import backend_exists, wait_for

from sa_jobqueue import JobLostError
from sa_jobqueue.aio import AsyncJobRepository
from sa_jobqueue.direct import MARKS_ONLY, DirectStatement

LEASE = timedelta(minutes=5)
async_jobs = AsyncJobRepository(TaskJob)


def _claimed(sessions: sessionmaker[Session], repo: Any = jobs) -> Any:
    with sessions.begin() as session:
        repo.enqueue(session, "noop")
    with sessions.begin() as session:
        [job] = repo.claim(session, lease=LEASE)
    return job


def test_a_completion_commits_with_the_sessions_writes_or_not_at_all(sessions: sessionmaker[Session]) -> None:
    kept, dropped = _claimed(sessions), _claimed(sessions)
    with sessions.begin() as session:
        session.add(Ledger(job_id=kept.id))
        jobs.complete(session, kept)
    with sessions() as session:
        session.add(Ledger(job_id=dropped.id))
        jobs.complete(session, dropped)
        session.rollback()
    with sessions() as session:
        assert list(session.scalars(select(Ledger.job_id))) == [kept.id]
        assert [j.id for j in session.scalars(select(TaskJob))] == [dropped.id]
        with pytest.raises(JobLostError):
            jobs.complete(session, kept)  # fenced: already finished


def test_a_table_that_keeps_jobs_gets_the_statements_own_values(sessions: sessionmaker[Session]) -> None:
    job = _claimed(sessions, reports)
    with sessions.begin() as session:
        reports.complete(session, job)
    with sessions() as session:
        row = session.get(type(job), job.id)
        assert row is not None and (row.status, row.lock_token, row.lease_expires_at) == ("done", None, None)
        assert row.finished_at is not None


def test_a_batched_completion_commits_with_the_sessions_writes_and_is_fenced(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    first, second, third = (_claimed(sessions) for _ in range(3))
    with sessions.begin() as session:
        jobs.complete(session, second)  # finished already: the fence leaves it out
    with sessions() as session:
        session.add(Ledger(job_id=first.id))
        assert jobs.complete_many(session, [first, second, third]) == {first.id, third.id}
        session.rollback()
    with sessions.begin() as session:
        session.add(Ledger(job_id=first.id))
        assert jobs.complete_many(session, [first, second, third]) == {first.id, third.id}
    with sessions() as session:
        assert list(session.scalars(select(Ledger.job_id))) == [first.id]
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0

    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    kept = _claimed(sessions, reports)
    event.listen(engine, "before_cursor_execute", record)
    try:
        with sessions.begin() as session:
            assert reports.complete_many(session, [kept]) == {kept.id}
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert any("UPDATE" in statement and "ANY" in statement for statement in seen)  # a listener sees it
    with sessions() as session:
        row = session.get(type(kept), kept.id)
        assert row is not None and (row.status, row.lock_token, row.lease_expires_at) == ("done", None, None)


def test_rows_come_straight_from_psycopg_unless_something_listens(engine: Engine) -> None:
    direct = DirectStatement(select(func.pg_backend_pid().label("pid"), text(":n AS n")))
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    with engine.connect() as conn:
        [row] = direct.rows(conn, {"n": 7})
        assert type(row) is tuple and row[1] == 7  # psycopg's own row: SQLAlchemy did not run it
        event.listen(engine, "before_cursor_execute", record)
        try:
            [row] = direct.rows(conn, {"n": 8})
        finally:
            event.remove(engine, "before_cursor_execute", record)
        assert type(row) is not tuple and row.n == 8 and len(seen) == 1  # a listener sees every statement


def test_a_schema_translate_map_is_honoured(db_url: Any, sessions: sessionmaker[Session]) -> None:
    public = _claimed(sessions)  # a job in the default schema's table, left alone
    base = create_engine(db_url)
    with base.begin() as conn:
        conn.execute(text("DROP SCHEMA IF EXISTS tenant_a CASCADE"))
        conn.execute(text("CREATE SCHEMA tenant_a"))
    tenant = base.execution_options(schema_translate_map={None: "tenant_a"})
    try:
        TaskJob.__table__.create(tenant)  # type: ignore[attr-defined]
        translated = sessionmaker(tenant, expire_on_commit=False)
        job = _claimed(translated)
        with translated.begin() as session:
            jobs.complete(session, job)  # sent to task_jobs, it would find no such job: JobLostError
        with translated() as session:
            assert session.scalar(select(func.count()).select_from(TaskJob)) == 0
        with sessions() as session:
            assert [j.id for j in session.scalars(select(TaskJob))] == [public.id]  # untouched
    finally:
        with base.begin() as conn:
            conn.execute(text("DROP SCHEMA tenant_a CASCADE"))
        base.dispose()


@pytest.fixture
def locker(engine: Engine) -> Iterator[Any]:
    with engine.connect() as conn:
        yield conn
        conn.rollback()


def test_a_driver_error_is_sqlalchemys_error_and_leaves_the_connection(
    sessions: sessionmaker[Session], locker: Any
) -> None:
    job = _claimed(sessions)
    locker.execute(select(TaskJob.id).where(TaskJob.id == job.id).with_for_update())
    with sessions() as session:
        session.execute(text("SET LOCAL lock_timeout = '50ms'"))
        with pytest.raises(sa_exc.OperationalError) as raised:
            jobs.complete(session, job)
        assert isinstance(raised.value.orig, psycopg.errors.LockNotAvailable)
        assert not raised.value.connection_invalidated
        assert "DELETE FROM task_jobs" in str(raised.value)
        session.rollback()
        assert session.scalar(text("SELECT 1")) == 1  # the connection still serves
    locker.rollback()
    with sessions.begin() as session:
        jobs.complete(session, job)


def test_a_lost_connection_invalidates_it(engine: Engine, sessions: sessionmaker[Session]) -> None:
    job = _claimed(sessions)
    with sessions() as session:
        connection = session.connection()
        pid = connection.scalar(select(func.pg_backend_pid()))
        with engine.connect() as killer:
            killer.execute(select(func.pg_terminate_backend(pid)))
            killer.commit()
        # A transaction of its own per look: pg_stat_activity is read once per transaction.
        wait_for(lambda: not backend_exists(engine, pid), 30, "the backend gone")
        with pytest.raises(sa_exc.DBAPIError) as raised:
            jobs.complete(session, job)
        assert raised.value.connection_invalidated and connection.invalidated
    with sessions.begin() as session:  # the pool gave the broken connection up
        jobs.complete(session, job)
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


def test_parameters_go_through_their_types_as_sqlalchemy_sends_them(engine: Engine) -> None:
    table = TaskJob.__table__
    direct = DirectStatement(insert(table).returning(table.c.id, table.c.payload),  # type: ignore[attr-defined]
                             results=[table.c.id.type, table.c.payload.type])  # type: ignore[attr-defined]
    payload = {"é": [1, {"b": None}], "n": 2**40}
    with engine.connect() as conn:
        [row] = direct.rows(conn, {"task": "noop", "payload": payload})
        assert type(row) is tuple and row[1] == payload  # the JSON type's processor wrote it
        [other] = direct.rows(conn, {"task": "noop", "queue": "other", "payload": None})  # other columns
        assert conn.execute(select(TaskJob.queue, TaskJob.payload).where(TaskJob.id == other[0])).one() == (
            "other", None)
        conn.rollback()


def test_arrays_of_ids_and_tokens_go_to_psycopg_in_binary_and_come_back_the_same(engine: Engine) -> None:
    """A batch's ids and lock tokens (arrays of integers, of UUIDs) are sent in
    psycopg's binary format, which costs the client a fraction of an array
    literal's work; other arrays as before. The values are the same either way."""
    direct = DirectStatement(select(bindparam("ids", type_=ARRAY(BigInteger)).label("ids"),
                                    bindparam("tokens", type_=ARRAY(Uuid)).label("tokens"),
                                    bindparam("names", type_=ARRAY(String)).label("names")))
    sent: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> tuple[str, Any]:
        sent.append(statement)
        return statement, parameters

    setattr(before, MARKS_ONLY, True)
    token = uuid.uuid4()
    cases = [
        ([1, -5, 2**40, 2**63 - 1], [token, uuid.UUID(int=0)], ["a", "é"]),
        ([], [], []),
        ([7, None], [None, token], [None]),
        (None, None, None),
    ]
    event.listen(engine, "before_cursor_execute", before, retval=True)
    try:
        with engine.connect() as conn:
            for ids, tokens, names in cases:
                [row] = direct.rows(conn, {"ids": ids, "tokens": tokens, "names": names})
                assert row == (ids, tokens, names)
            with pytest.raises(sa_exc.DBAPIError):  # as out of range as in an array literal
                direct.rows(conn, {"ids": [2**63], "tokens": [], "names": []})
    finally:
        event.remove(engine, "before_cursor_execute", before)
    assert "%(ids)b" in sent[0] and "%(tokens)b" in sent[0] and "%(names)s" in sent[0]


def test_listeners_that_only_mark_statements_are_run_by_it_and_are_no_reason_to_fall_back(engine: Engine) -> None:
    """The asyncio watchdog's listeners (named by ``MARKS_ONLY``) mark each
    statement in flight: a direct statement calls them itself, before and
    after, and still goes straight to the driver; any other listener beside
    them sends it through SQLAlchemy."""
    direct = DirectStatement(select(func.pg_backend_pid().label("pid"), text(":n AS n")))
    calls: list[tuple[str, str]] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> tuple[str, Any]:
        calls.append(("before", statement))
        return statement, parameters

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        calls.append(("after", statement))

    def other(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        calls.append(("other", statement))

    setattr(before, MARKS_ONLY, True)
    setattr(after, MARKS_ONLY, True)
    event.listen(engine, "before_cursor_execute", before, retval=True)
    event.listen(engine, "after_cursor_execute", after)
    try:
        with engine.connect() as conn:
            [row] = direct.rows(conn, {"n": 7})
            assert type(row) is tuple and row[1] == 7  # psycopg's own row: SQLAlchemy did not run it
            assert [name for name, _ in calls] == ["before", "after"]
            assert calls[0][1] == calls[1][1] and "pg_backend_pid" in calls[0][1]
            calls.clear()
            event.listen(engine, "after_cursor_execute", other)
            try:
                [row] = direct.rows(conn, {"n": 8})
            finally:
                event.remove(engine, "after_cursor_execute", other)
            assert type(row) is not tuple and row.n == 8  # through SQLAlchemy: every listener sees it
            assert sorted(name for name, _ in calls) == ["after", "before", "other"]
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)


# -- an AsyncSession's statements: psycopg's async driver through SQLAlchemy's DBAPI adapter -----------------


@pytest.mark.anyio
async def test_an_async_connection_sends_them_straight_through_the_driver(async_engine: AsyncEngine) -> None:
    direct = DirectStatement(select(func.pg_backend_pid().label("pid"), bindparam("n", type_=Integer).label("n")))
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    async with async_engine.connect() as conn:
        [row] = await conn.run_sync(lambda sync: direct.rows(sync, {"n": 7}))
        assert type(row) is tuple and row[1] == 7  # the driver's row: SQLAlchemy did not run it
        event.listen(async_engine.sync_engine, "before_cursor_execute", record)
        try:
            [row] = await conn.run_sync(lambda sync: direct.rows(sync, {"n": 8}))
        finally:
            event.remove(async_engine.sync_engine, "before_cursor_execute", record)
        assert type(row) is not tuple and row.n == 8 and len(seen) == 1  # a listener sees every statement


@pytest.fixture
async def async_sessions(db_url: Any, engine: Engine, async_driver: str) -> AsyncIterator[
        async_sessionmaker[AsyncSession]]:
    """Sessions of an async engine, through each async driver."""
    made = create_async_engine(db_url.set(drivername=f"postgresql+{async_driver}"))
    try:
        yield async_sessionmaker(made, expire_on_commit=False)
    finally:
        await made.dispose()


@pytest.mark.anyio
async def test_an_async_completion_commits_with_the_sessions_writes_or_not_at_all(
    sessions: sessionmaker[Session], async_sessions: async_sessionmaker[AsyncSession]
) -> None:
    kept, dropped = _claimed(sessions), _claimed(sessions)
    async with async_sessions.begin() as session:
        session.add(Ledger(job_id=kept.id))
        await async_jobs.complete(session, kept)
    async with async_sessions() as session:
        session.add(Ledger(job_id=dropped.id))
        await async_jobs.complete(session, dropped)
        await session.rollback()
    with sessions() as session:
        assert list(session.scalars(select(Ledger.job_id))) == [kept.id]
        assert [j.id for j in session.scalars(select(TaskJob))] == [dropped.id]


@pytest.mark.anyio
async def test_an_async_batched_completion_commits_with_the_sessions_writes_and_is_fenced(
    sessions: sessionmaker[Session], async_sessions: async_sessionmaker[AsyncSession]
) -> None:
    first, second, third = (_claimed(sessions) for _ in range(3))
    async with async_sessions.begin() as session:
        await async_jobs.complete(session, second)  # finished already: the fence leaves it out
    async with async_sessions() as session:
        session.add(Ledger(job_id=first.id))
        assert await async_jobs.complete_many(session, [first, second, third]) == {first.id, third.id}
        await session.rollback()
    async with async_sessions.begin() as session:
        session.add(Ledger(job_id=first.id))
        assert await async_jobs.complete_many(session, [first, second, third]) == {first.id, third.id}
    with sessions() as session:
        assert list(session.scalars(select(Ledger.job_id))) == [first.id]
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


async def _locked_out(session: AsyncSession, run: Any) -> sa_exc.DBAPIError:
    """What ``run`` raises when its row is locked: the session's lock timeout expires."""
    await session.execute(text("SET LOCAL lock_timeout = '50ms'"))
    with pytest.raises(sa_exc.DBAPIError) as raised:
        await run()
    await session.rollback()
    return raised.value


@pytest.mark.anyio
async def test_an_async_driver_error_is_sqlalchemys_error_and_leaves_the_connection(
    sessions: sessionmaker[Session], async_sessions: async_sessionmaker[AsyncSession], locker: Any
) -> None:
    job = _claimed(sessions)
    locker.execute(select(TaskJob.id).where(TaskJob.id == job.id).with_for_update())
    async with async_sessions() as session:
        direct = await _locked_out(session, lambda: async_jobs.complete(session, job))
        assert "DELETE FROM task_jobs" in str(direct) and not direct.connection_invalidated
        assert await session.scalar(text("SELECT 1")) == 1  # the connection still serves
        # The same error as SQLAlchemy raises for a statement of its own on this driver.
        through = await _locked_out(session, lambda: session.execute(
            text("DELETE FROM task_jobs WHERE id = :id"), {"id": job.id}))
        assert (type(direct), type(direct.orig)) == (type(through), type(through.orig))
        assert "lock timeout" in str(direct.orig)
    locker.rollback()
    async with async_sessions.begin() as session:
        await async_jobs.complete(session, job)


@pytest.mark.anyio
async def test_a_lost_async_connection_invalidates_it(
    engine: Engine, sessions: sessionmaker[Session], async_sessions: async_sessionmaker[AsyncSession]
) -> None:
    job = _claimed(sessions)
    async with async_sessions() as session:
        connection = await session.connection()
        pid = await connection.scalar(select(func.pg_backend_pid()))
        with engine.connect() as killer:
            killer.execute(select(func.pg_terminate_backend(pid)))
            killer.commit()
        wait_for(lambda: not backend_exists(engine, pid), 30, "the backend gone")
        with pytest.raises(sa_exc.DBAPIError) as raised:
            await async_jobs.complete(session, job)
        assert raised.value.connection_invalidated and connection.invalidated
    async with async_sessions.begin() as session:  # the pool gave the broken connection up
        await async_jobs.complete(session, job)
        assert await session.scalar(select(func.count()).select_from(TaskJob)) == 0
