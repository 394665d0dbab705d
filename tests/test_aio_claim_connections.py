"""The asyncio worker's claims run on connections of its own engine kept from
one claim to the next (sa_jobqueue/worker/held.py's KeptConnections,
sa_jobqueue/aio/lease.py); one the server dropped is replaced at the next
claim, and the kept ones go back to the pool at the worker's end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from jobapp import TaskJob
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from waiting import terminate_backend, wait_for, wait_for_async

from sa_jobqueue import TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker
from sa_jobqueue.worker.held import KeptConnections

jobs = AsyncJobRepository(TaskJob)


def _claimer_backends(engine: Engine) -> set[int]:
    """The backends whose last statement was a claim of task_jobs."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT pid FROM pg_stat_activity WHERE query LIKE 'WITH picked AS%'"
                                 " AND query LIKE '%task_jobs%' AND pid <> pg_backend_pid()"))
        return {row.pid for row in rows}


def test_kept_connections_are_taken_again_until_unusable_and_released_to_the_pool(engine: Engine) -> None:
    own = create_engine(engine.url, pool_size=2, max_overflow=0)
    kept = KeptConnections(own)
    try:
        first = kept.take()
        pid = first.scalar(select(func.pg_backend_pid()))
        first.rollback()
        kept.give(first)
        again = kept.take()
        assert again is first  # kept, not returned to the pool and checked out again
        other = kept.take()  # taken while the first is out: a connection of its own
        assert other is not again and own.pool.checkedout() == 2  # type: ignore[attr-defined]
        kept.give(other)
        again.invalidate()  # an error made it unusable: given back, never handed out again
        kept.give(again)
        fresh = kept.take()
        assert fresh is other
        assert fresh.scalar(select(func.pg_backend_pid())) != pid
        fresh.rollback()
        kept.give(fresh)
        kept.release()
        assert own.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        own.dispose()


def test_a_connection_given_after_the_release_goes_back_to_the_pool(engine: Engine) -> None:
    """A claim that outlived the worker's end gives its connection back: nothing keeps it."""
    own = create_engine(engine.url, pool_size=2, max_overflow=0)
    kept = KeptConnections(own)
    try:
        late = kept.take()
        kept.release()
        kept.give(late)
        assert late.closed and own.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        own.dispose()


@pytest.mark.anyio
async def test_a_claims_connection_is_kept_and_replaced_when_the_server_drops_it(
    async_engine: AsyncEngine, engine: Engine, running: list[asyncio.Task[Any]]
) -> None:
    sessions = async_sessionmaker(async_engine, expire_on_commit=False)
    tasks = TaskRegistry()
    done: list[int] = []

    @tasks.task
    async def mark(job: TaskJob) -> None:
        done.append(job.id)

    async def enqueue() -> None:
        async with sessions.begin() as session:
            await jobs.enqueue(session, "mark")

    worker = AsyncWorker(async_engine, jobs, tasks, concurrency=1, poll_interval=0.1)
    task = asyncio.get_running_loop().create_task(worker.run(handle_signals=False))
    running.append(task)
    killer = create_engine(engine.url)
    try:
        for n in range(3):
            await enqueue()
            await wait_for_async(lambda n=n: len(done) == n + 1, 60, f"job {n + 1} run")
        held = await asyncio.to_thread(_claimer_backends, killer)
        assert held
        for pid in held:
            await asyncio.to_thread(terminate_backend, killer, pid, "the claim's backend gone")
        await enqueue()
        # A claim on a dropped connection fails and is logged; the next one
        # checks out a new connection.
        await wait_for_async(lambda: len(done) == 4, 60, "the job after the drop run")
        replaced = await asyncio.to_thread(_claimer_backends, killer)
        assert replaced and not (replaced & held)
    finally:
        worker.stop()
        result = await asyncio.wait_for(task, 60)
        killer.dispose()
    assert result.completed == 4
    # At its end the worker gave back the connections it kept, and its own pool
    # closed them (kept out of the pool, they would outlive the worker).
    # Backends exit after their client closed them, not at that instant: wait.
    await asyncio.to_thread(wait_for, lambda: not _claimer_backends(engine), 30, "the claim connections closed")
