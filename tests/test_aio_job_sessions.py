"""The asyncio worker's job sessions in lease mode: a fresh AsyncSession per
job, on a connection kept for the next job while claimed jobs wait
(sa_jobqueue/aio/job_sessions.py), on both async drivers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from jobapp import Ledger, TaskJob
from sqlalchemy import Engine, create_engine, event, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session
from waiting import terminate_backend

from sa_jobqueue import JobSpec, TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker
from sa_jobqueue.aio.job_sessions import AsyncJobSessions, holds_connections

pytestmark = pytest.mark.anyio

jobs = AsyncJobRepository(TaskJob)


@pytest.fixture
def sessions(async_engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(async_engine, expire_on_commit=False)


def _seen_by(tasks: TaskRegistry, checkins: list[int] | None = None) -> list[dict[str, Any]]:
    """Register ``look``: it records what its session is (and ``checkins[0]``
    as it runs), then writes a ledger row."""
    seen: list[dict[str, Any]] = []

    @tasks.task
    async def look(job: TaskJob, session: AsyncSession) -> None:
        seen.append({
            "job": job.id,
            "pid": await session.scalar(select(func.pg_backend_pid())),
            "isolation": await session.scalar(text("SELECT current_setting('transaction_isolation')")),
            "session": session.sync_session.hash_key,
            "info": dict(session.info),
            "identity": len(session.identity_map),
            "bind": session.bind,
            "checkins": checkins[0] if checkins else None,
        })
        session.info["job"] = job.id  # must not reach the next job's session
        session.add(Ledger(job_id=job.id))
        await session.flush()  # the row is now in this session's identity map

    return seen


def _count_checkins(engine: AsyncEngine) -> list[int]:
    """Count the connections given back to ``engine``'s pool (the jobs'
    sessions': the worker's own statements have a pool of their own)."""
    checkins = [0]

    def checkin(*_: Any) -> None:
        checkins[0] += 1

    event.listen(engine.sync_engine, "checkin", checkin)
    return checkins


def _ledger_count(engine: Engine) -> int:
    with Session(engine) as session:
        return int(session.scalar(select(func.count()).select_from(Ledger)) or 0)


async def test_consecutive_jobs_share_a_kept_connection_and_never_a_session(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    tasks = TaskRegistry()
    checkins = _count_checkins(async_engine)
    seen = _seen_by(tasks, checkins)
    async with sessions.begin() as session:
        await jobs.enqueue_many(session, [JobSpec("look") for _ in range(6)])
    result = await AsyncWorker(async_engine, jobs, tasks, concurrency=1, batch_size=6, listen=False,
                               poll_interval=0.1).run(until_empty=True, handle_signals=False)
    assert result.completed == 6
    # The six jobs, claimed at once, ran one after another on one connection,
    # kept between them: none went back to the pool from the first job to the last.
    assert len({s["checkins"] for s in seen}) == 1, [s["checkins"] for s in seen]
    assert len({s["pid"] for s in seen}) == 1
    assert len({s["session"] for s in seen}) == 6  # a new session for each
    assert all(s["info"] == {} and s["identity"] == 0 for s in seen)
    assert all(s["bind"] is async_engine for s in seen)  # as anywhere else: the engine, not the kept connection
    assert {s["isolation"] for s in seen} == {"read committed"}
    assert async_engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]  # all back at the end
    assert _ledger_count(engine) == 6


async def test_kept_connections_go_back_to_the_pool_once_no_job_waits(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], running: list[asyncio.Task[Any]]
) -> None:
    tasks = TaskRegistry()
    seen = _seen_by(tasks)
    worker = AsyncWorker(async_engine, jobs, tasks, concurrency=2, poll_interval=0.1)
    task = asyncio.get_running_loop().create_task(worker.run(handle_signals=False))
    running.append(task)
    async with sessions.begin() as session:
        await jobs.enqueue_many(session, [JobSpec("look") for _ in range(3)])
    pool = async_engine.sync_engine.pool
    deadline = asyncio.get_running_loop().time() + 30
    while len(seen) < 3 or pool.checkedout():  # type: ignore[attr-defined]
        assert asyncio.get_running_loop().time() < deadline, (len(seen), pool.checkedout())  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
    worker.stop()
    result = await asyncio.wait_for(task, 30)
    assert result.completed == 3


async def test_a_job_that_closes_after_the_workers_end_gives_its_connection_back(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """A job that outlived the worker's end (past its grace) keeps nothing, even while jobs wait."""
    job_sessions = AsyncJobSessions(sessions)
    job_sessions.jobs_wait = lambda: True
    opened = await job_sessions.open()
    await job_sessions.release_idle()
    await job_sessions.close(opened)
    assert async_engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def test_a_connection_a_job_made_unusable_is_not_kept(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    tasks = TaskRegistry()
    pids: list[int] = []
    killer = create_engine(engine.url)

    @tasks.task
    async def lose_connection(job: TaskJob, session: AsyncSession) -> None:
        pid = await session.scalar(select(func.pg_backend_pid()))
        assert pid is not None
        pids.append(pid)
        if len(pids) == 1:  # the first job's connection is terminated under it
            terminate_backend(killer, pid, "the job's backend gone")
            await session.execute(text("SELECT 1"))  # fails: the connection is gone
        session.add(Ledger(job_id=job.id))
        await session.flush()

    try:
        async with sessions.begin() as session:
            first = await jobs.enqueue(session, "lose_connection")
            await jobs.enqueue_many(session, [JobSpec("lose_connection") for _ in range(3)])
        result = await AsyncWorker(async_engine, jobs, tasks, concurrency=1, batch_size=4, listen=False,
                                   poll_interval=0.1).run(until_empty=True, handle_signals=False)
    finally:
        killer.dispose()
    assert result.completed == 3 and result.retried == 1
    assert pids[0] not in pids[1:]  # the next jobs ran on a new connection
    assert async_engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    with Session(engine) as session:
        row = session.get(TaskJob, first.id)
        assert row is not None and row.status == "pending" and row.attempts == 1


async def test_a_session_a_handler_opens_on_its_bind_is_a_session_of_its_own(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    """``AsyncSession(session.bind)`` in a handler (an audit row that must
    commit whatever the job does) gets a connection of its own from the
    pool: its commit commits, even when the job then fails."""
    tasks = TaskRegistry()
    backends: list[tuple[int, int]] = []  # each job's: its session's, and its own session's

    @tasks.task(max_attempts=1)
    async def audited(job: TaskJob, session: AsyncSession) -> None:
        pid = await session.scalar(select(func.pg_backend_pid()))
        async with AsyncSession(session.bind) as own:
            backends.append((pid or 0, await own.scalar(select(func.pg_backend_pid())) or 0))
            own.add(Ledger(job_id=job.id, note="audit"))
            await own.commit()
        if job.payload.get("fail"):
            raise RuntimeError("the job fails after its audit row committed")

    async with sessions.begin() as session:
        ok = await jobs.enqueue(session, "audited")
        failing = await jobs.enqueue(session, "audited", payload={"fail": True})
        later = await jobs.enqueue(session, "audited")
    result = await AsyncWorker(async_engine, jobs, tasks, concurrency=1, batch_size=3, listen=False,
                               poll_interval=0.1).run(until_empty=True, handle_signals=False)
    assert result.completed == 2 and result.dead == 1
    assert len(backends) == 3 and all(job != own for job, own in backends)  # never the job's connection
    with Session(engine) as session:
        notes = {job_id: note for job_id, note in session.execute(select(Ledger.job_id, Ledger.note))}
        assert notes == {ok.id: "audit", failing.id: "audit", later.id: "audit"}
        dead = session.get(TaskJob, failing.id)
        assert dead is not None and dead.status == "dead"


def test_only_a_plain_sessionmaker_of_one_engine_has_its_connections_kept() -> None:
    """Plain objects: no connection is made."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")

    class Routing(Session):
        def get_bind(self, *args: Any, **kw: Any) -> Any:  # picks its connections its own way
            return super().get_bind(*args, **kw)

    assert holds_connections(async_sessionmaker(engine)) is engine
    assert holds_connections(async_sessionmaker(engine, sync_session_class=Routing)) is None
    assert holds_connections(async_sessionmaker(binds={TaskJob: engine})) is None
    assert holds_connections(async_sessionmaker()) is None
