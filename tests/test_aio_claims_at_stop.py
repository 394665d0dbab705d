"""A claim in flight when the asyncio worker's run ends (both drivers).

A claim runs as a task of its own, beside ``run()``. Whichever way the run
ends (its task cancelled, as a TaskGroup or a server's shutdown does; a
graceful stop whose ``shutdown_timeout`` passes before the claim returns;
an immediate stop), no claim of the worker outlives ``run()``: it is
cancelled and waited for, so it never starts a job after the worker ended,
and its connection goes back to the pool instead of being kept for a claim
that will never come (it used to be, and the garbage collector then found
a connection never checked in).

The claim is held in flight deterministically: a trigger on the job table
takes an advisory lock the test holds, so the claim's UPDATE waits on the
server until the test lets it go.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from jobapp import TaskJob
from sqlalchemy import Engine, text
from sqlalchemy.exc import SAWarning
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from waiting import wait_for, wait_for_async

from sa_jobqueue import TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker

pytestmark = pytest.mark.anyio

jobs = AsyncJobRepository(TaskJob)
LOCK_KEY = 7_310_422  # the advisory lock the trigger waits for


@pytest.fixture
def claims_wait(engine: Engine) -> Iterator[Any]:
    """While the test holds this fixture's connection's advisory lock, a claim
    of task_jobs waits on the server; the trigger is dropped at the end."""
    with engine.begin() as conn:
        conn.execute(text(f"""
            CREATE FUNCTION sajq_test_claim_waits() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF OLD.status = 'pending' AND NEW.status = 'running' THEN
                    PERFORM pg_advisory_xact_lock({LOCK_KEY});
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER sajq_test_claim_waits BEFORE UPDATE ON task_jobs
                FOR EACH ROW EXECUTE FUNCTION sajq_test_claim_waits();
        """))
    holder = engine.connect()
    try:
        holder.execute(text(f"SELECT pg_advisory_lock({LOCK_KEY})"))
        holder.commit()
        yield holder
    finally:
        holder.execute(text("SELECT pg_advisory_unlock_all()"))
        holder.commit()
        holder.close()
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER sajq_test_claim_waits ON task_jobs; "
                              "DROP FUNCTION sajq_test_claim_waits()"))


def _claims_waiting(engine: Engine) -> list[int]:
    """The backends waiting for the test's advisory lock: the worker's claims."""
    with engine.connect() as conn:
        return list(conn.scalars(text(
            "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
            "WHERE l.locktype = 'advisory' AND NOT l.granted AND a.datname = current_database()"
        )))


def _claim_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "sa_jobqueue-claim" and not t.done()]


@pytest.mark.parametrize("ending", ["run cancelled", "stop past its shutdown timeout", "stop now"])
async def test_no_claim_outlives_run_and_its_connection_goes_back_to_the_pool(
    async_engine: AsyncEngine, engine: Engine, claims_wait: Any, ending: str,
) -> None:
    registry = TaskRegistry()
    ran: list[int] = []

    @registry.task
    async def noop(job: TaskJob) -> None:
        ran.append(job.id)

    async with async_sessionmaker(async_engine)() as session:
        await jobs.enqueue(session, "noop")
        await session.commit()
    worker = AsyncWorker(async_engine, jobs, registry, listen=False, poll_interval=0.05, shutdown_timeout=0.1)
    task = asyncio.get_running_loop().create_task(worker.run(handle_signals=False))
    try:
        await wait_for_async(lambda: bool(_claims_waiting(engine)), 60, "the worker's claim to wait on the lock")
        assert _claim_tasks(), "the claim runs as a task of its own"
        if ending == "run cancelled":
            task.cancel()
        else:
            worker.stop(now=ending == "stop now")
        await asyncio.wait({task}, timeout=60)
        assert task.done()
        # The claim was cancelled and waited for: none is left to land later,
        # start a job in a worker that has ended, or keep its connection.
        assert _claim_tasks() == []
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=60)
        for pid in _claims_waiting(engine):  # the cancelled statement, left on the server: ended
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()  # a connection dropped without its checkin is reported here
    leaked = [w for w in caught if issubclass(w.category, SAWarning) and "non-checked-in" in str(w.message)]
    assert leaked == []
    assert ran == []
    wait_for(lambda: _claims_waiting(engine) == [], 60, "the claim's backend to end")

