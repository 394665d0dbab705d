"""AsyncWorker in transaction mode, on both async drivers: a batch claimed,
run (each job in a SAVEPOINT) and finished in one transaction; a failure
rolls back only its job; deadlines cancel the statement (or the coroutine)
and roll back only that job; a stop hands back what a batch did not start;
consecutive jobs of group_commit tasks share one SAVEPOINT."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from jobapp import Ledger, TaskJob
from sqlalchemy import Engine, event, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from sa_jobqueue import TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker

pytestmark = pytest.mark.anyio

jobs = AsyncJobRepository(TaskJob)


@pytest.fixture
def sessions(async_engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(async_engine, expire_on_commit=False)


async def _enqueue(sessions: async_sessionmaker[AsyncSession], task: str, n: int = 1) -> list[int]:
    async with sessions.begin() as session:
        return [(await jobs.enqueue(session, task)).id for _ in range(n)]


def _ledger(engine: Engine) -> list[int]:
    with Session(engine) as session:
        return sorted(session.scalars(select(Ledger.job_id)))


def _row(engine: Engine, job_id: int) -> TaskJob | None:
    with Session(engine) as session:
        return session.get(TaskJob, job_id)


def _worker(async_engine: AsyncEngine, registry: TaskRegistry, **options: Any) -> AsyncWorker:
    return AsyncWorker(async_engine, jobs, registry, mode="transaction", listen=False, poll_interval=0.05,
                       **options)


async def test_batches_commit_their_jobs_writes_with_their_completions_and_a_failure_rolls_back_alone(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()

    @registry.task
    async def writes(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="async"))

    @registry.task
    def sync_writes(job: TaskJob, session: Session) -> None:  # runs on the batch's Session, in run_sync
        session.add(Ledger(job_id=job.id, note="sync"))

    @registry.task
    def in_thread(job: TaskJob) -> None:
        pass

    @registry.task(max_attempts=1)
    async def fails(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="never"))
        await session.flush()
        raise ValueError("fails alone")

    written = await _enqueue(sessions, "writes", 15) + await _enqueue(sessions, "sync_writes", 5)
    await _enqueue(sessions, "in_thread", 5)
    (failing,) = await _enqueue(sessions, "fails")
    result = await _worker(async_engine, registry, concurrency=3, batch_size=10).run(until_empty=True)
    assert result.completed == 25 and result.dead == 1 and result.lost == 0
    assert _ledger(engine) == sorted(written)
    row = _row(engine, failing)
    assert row is not None and row.status == "dead" and row.last_error is not None and "fails alone" in row.last_error


@pytest.mark.parametrize("waits_on", ["the server", "the network"])
async def test_a_deadline_rolls_back_only_its_job_and_the_batch_commits_the_rest(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine, waits_on: str
) -> None:
    registry = TaskRegistry()

    @registry.task(timeout=0.5, max_attempts=1)
    async def slow(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="never"))
        await session.flush()
        if waits_on == "the server":
            await session.execute(text("SELECT pg_sleep(60)"))  # cancelled on the server
        else:
            await asyncio.sleep(60)  # its coroutine cancelled, a grace later

    @registry.task
    async def quick(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="kept"))

    first = await _enqueue(sessions, "quick", 2)
    (slow_id,) = await _enqueue(sessions, "slow")
    last = await _enqueue(sessions, "quick", 2)
    result = await asyncio.wait_for(_worker(async_engine, registry, concurrency=1, batch_size=10)
                                    .run(until_empty=True), 50)  # 60 s waits did not run out
    assert result.completed == 4 and result.dead == 1
    assert _ledger(engine) == sorted(first + last)  # one batch: its other jobs committed
    row = _row(engine, slow_id)
    assert row is not None and row.status == "dead" and row.last_error == "timed out after 0.5 s"


async def test_a_stop_hands_back_the_jobs_a_batch_did_not_start(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()
    worker: list[AsyncWorker] = []

    @registry.task
    async def stops(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id))
        worker[0].stop()  # the batch runs no further job

    ids = await _enqueue(sessions, "stops", 5)
    worker.append(_worker(async_engine, registry, concurrency=1, batch_size=5))
    result = await worker[0].run()
    assert result.completed == 1 and result.handed_back == 4
    assert _ledger(engine) == ids[:1]
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(TaskJob).where(
            TaskJob.status == "pending", TaskJob.attempts == 0)) == 4


# -- grouped commits: consecutive jobs of group_commit tasks share one SAVEPOINT ---------


def _grouped(registry: TaskRegistry, runs: Counter[int], *, fail: int | None = None, slow: int | None = None) -> None:
    """``write`` (async) and ``write_sync`` (on the batch's Session): a ledger row
    each; job ``fail`` raises, job ``slow`` sleeps on the server past its 0.5 s deadline."""

    @registry.task(group_commit=True, max_attempts=1, timeout=0.5)
    async def write(job: TaskJob, session: AsyncSession) -> None:
        runs[job.id] += 1
        if job.id == fail:
            raise ValueError("fails alone")
        if job.id == slow:
            await session.execute(text("SELECT pg_sleep(60)"))
        session.add(Ledger(job_id=job.id, note="grouped"))

    @registry.task(group_commit=True)
    def write_sync(job: TaskJob, session: Session) -> None:
        runs[job.id] += 1
        session.add(Ledger(job_id=job.id, note="grouped, sync"))


async def test_grouped_jobs_of_a_batch_share_one_savepoint(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry, runs = TaskRegistry(), Counter[int]()
    _grouped(registry, runs)
    ids = await _enqueue(sessions, "write", 5) + await _enqueue(sessions, "write_sync", 5)
    sent: list[str] = []

    def look(conn: object, cursor: object, statement: str, *rest: object) -> None:
        if statement.startswith("SAVEPOINT"):
            sent.append(statement)

    event.listen(async_engine.sync_engine, "before_cursor_execute", look)
    try:
        result = await _worker(async_engine, registry, concurrency=1, batch_size=10).run(until_empty=True)
    finally:
        event.remove(async_engine.sync_engine, "before_cursor_execute", look)
    assert result.completed == 10
    assert len(sent) == 1
    assert _ledger(engine) == sorted(ids) and set(runs.values()) == {1}


@pytest.mark.parametrize("trouble", ["a failure", "a deadline"])
async def test_trouble_in_a_group_settles_that_job_alone_and_the_others_commit_once(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine, trouble: str
) -> None:
    registry, runs = TaskRegistry(), Counter[int]()
    ids = await _enqueue(sessions, "write", 8)
    culprit = ids[3]
    _grouped(registry, runs, **({"fail": culprit} if trouble == "a failure" else {"slow": culprit}))
    result = await asyncio.wait_for(_worker(async_engine, registry, concurrency=1, batch_size=8)
                                    .run(until_empty=True), 50)  # the 60 s sleep did not run out
    assert (result.completed, result.dead) == (7, 1)
    assert _ledger(engine) == sorted(set(ids) - {culprit})
    row = _row(engine, culprit)
    assert row is not None and row.status == "dead"
    assert row.last_error is not None and ("fails alone" in row.last_error or row.last_error == "timed out after 0.5 s")
    assert runs[culprit] == 1
    assert [runs[i] for i in ids[:3]] == [2, 2, 2]  # ran in the group, rolled back with it, then alone
    assert [runs[i] for i in ids[4:]] == [1, 1, 1, 1]
