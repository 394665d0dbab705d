"""The asyncio workloads of benchmarks/run.py: enqueue on an AsyncSession.

Kept apart so that run.py imports SQLAlchemy's asyncio support (greenlet,
asyncpg) only when these workloads run, and only from a core that has
``sa_jobqueue.aio``.
"""

from __future__ import annotations

import asyncio
import time

from sqlalchemy.engine import URL

DRIVERS = ("psycopg", "asyncpg")
# The I/O-bound workload: each handler waits this long; the asyncio worker runs
# this many jobs in flight, the thread worker this many threads.
IO_WAIT = 0.05
IO_IN_FLIGHT = (100, 500)
IO_THREADS = (16, 64)


def has_aio() -> bool:
    """Whether the core under test has the asyncio API (a core before it has not)."""
    try:
        import sa_jobqueue.aio  # noqa: F401
    except ImportError:
        return False
    return True


def has_async_worker() -> bool:
    """Whether the core under test has the asyncio worker."""
    try:
        from sa_jobqueue.aio import AsyncWorker  # noqa: F401
    except ImportError:
        return False
    return True


def enqueue_async(url: URL, driver: str, *, count: int, warm: int, task: str, queue: str) -> float:
    """Jobs/s of ``count`` enqueues, one per transaction, each on an
    AsyncSession of ``driver`` (after ``warm`` untimed ones)."""
    return asyncio.run(_enqueue(url, driver, count=count, warm=warm, task=task, queue=queue))


async def _enqueue(url: URL, driver: str, *, count: int, warm: int, task: str, queue: str) -> float:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sa_jobqueue.aio import AsyncJobRepository
    from sa_jobqueue.default import Job

    engine = create_async_engine(url.set(drivername=f"postgresql+{driver}"), pool_size=1)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    repo = AsyncJobRepository(Job)
    try:
        async def one(n: int) -> None:
            async with sessions() as session, session.begin():
                await repo.enqueue(session, task, {"n": n}, queue=queue)

        for n in range(warm):
            await one(n)
        started = time.perf_counter()
        for n in range(count):
            await one(n)
        return count / (time.perf_counter() - started)
    finally:
        await engine.dispose()
