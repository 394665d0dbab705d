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


def enqueue_async(url: URL, driver: str, *, count: int, warm: int, task: str, queue: str) -> tuple[float, float]:
    """Jobs/s of ``count`` enqueues, one per transaction, each on an AsyncSession of
    ``driver`` (after ``warm`` untimed ones), and beside them the same loop with the
    job's row written by a plain Core ``INSERT … RETURNING id`` instead of ``enqueue``
    (the same work done naively on the same stack); the two interleaved in rounds.
    Each way writes ``warm + count`` rows."""
    return asyncio.run(_enqueue(url, driver, count=count, warm=warm, task=task, queue=queue))


async def _enqueue(url: URL, driver: str, *, count: int, warm: int, task: str,
                   queue: str) -> tuple[float, float]:
    from sqlalchemy import insert
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sa_jobqueue.aio import AsyncJobRepository
    from sa_jobqueue.default import Job

    engine = create_async_engine(url.set(drivername=f"postgresql+{driver}"), pool_size=1)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    repo = AsyncJobRepository(Job)
    plain_insert = insert(Job.__table__).returning(Job.__table__.c.id)
    try:
        async def one(way: str, n: int) -> None:
            async with sessions() as session, session.begin():
                if way == "enqueue":
                    await repo.enqueue(session, task, {"n": n}, queue=queue)
                else:
                    await session.execute(plain_insert, {"task": task, "payload": {"n": n}, "queue": queue})

        ways = ("enqueue", "insert")
        for n in range(warm):
            for way in ways:
                await one(way, n)
        spent = dict.fromkeys(ways, 0.0)
        rounds = 10
        for _ in range(rounds):
            for way in ways:
                started = time.perf_counter()
                for n in range(count // rounds):
                    await one(way, n)
                spent[way] += time.perf_counter() - started
        done = rounds * (count // rounds)
        return done / spent["enqueue"], done / spent["insert"]
    finally:
        await engine.dispose()
