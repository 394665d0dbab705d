"""The queue verbs on an AsyncSession behind PgBouncer in transaction pooling
(before 1.21: no prepared statements tracked), on both async drivers, with
the settings docs/asyncio.md gives: enqueue, claim, complete, and COPY of
bulk rows, from several engines at once sharing the server connections."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from bouncer import PgBouncer
from pgserver import PgServer
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from sa_jobqueue import JobSpec
from sa_jobqueue.aio import AsyncJobRepository
from sa_jobqueue.default import Job

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

jobs = AsyncJobRepository(Job)
ENGINES, ROUNDS, BULK = 3, 20, 20  # 20 rounds: psycopg would prepare after 5, asyncpg at once

# What docs/asyncio.md says each driver needs behind PgBouncer before 1.21.
SETTINGS: dict[str, Callable[[], dict[str, Any]]] = {
    "psycopg": lambda: {"prepare_threshold": None},
    "asyncpg": lambda: {"statement_cache_size": 0, "prepared_statement_cache_size": 0,
                        "prepared_statement_name_func": lambda: f"__asyncpg_{uuid.uuid4()}__"},
}


async def _rounds(engine: AsyncEngine, queue: str) -> None:
    """Enqueue a job and claim and complete it (on a queue of this engine's own, so the
    claim always finds it), then enqueue BULK rows through COPY; ROUNDS times."""
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    for n in range(ROUNDS):
        async with sessions() as session, session.begin():
            await jobs.enqueue(session, "single", {"n": n}, queue=queue)
        async with sessions() as session, session.begin():
            [job] = await jobs.claim(session, queues=queue)
            await jobs.complete(session, job)
        async with sessions() as session, session.begin():
            await jobs.enqueue_many(session, [JobSpec("bulk", {"n": n, "i": i}, queue="bulk") for i in range(BULK)])


@pytest.mark.parametrize("driver", sorted(SETTINGS))
def test_the_async_verbs_work_behind_pgbouncer_with_the_documented_settings(chaos_server: PgServer,
                                                                           driver: str) -> None:
    name = f"sajq_aio_bouncer_{driver}"
    with psycopg.connect(chaos_server.url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    direct = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{chaos_server.port}/{name}")
    try:
        Job.metadata.create_all(direct)
        with PgBouncer(chaos_server.port, pool_size=2) as bouncer:  # 6 client connections on 2 server ones
            url = bouncer.url_for(name).replace("postgresql://", f"postgresql+{driver}://")

            async def main() -> None:
                engines = [create_async_engine(url, connect_args=SETTINGS[driver](), pool_size=2)
                           for _ in range(ENGINES)]
                try:
                    await asyncio.gather(*(_rounds(engine, f"single-{i}") for i, engine in enumerate(engines)))
                finally:
                    for engine in engines:
                        await engine.dispose()

            asyncio.run(main())
        with direct.connect() as conn:
            rows = dict(conn.exec_driver_sql("SELECT queue, count(*) FROM sa_jobqueue_jobs GROUP BY queue").all())
        # Every single job was claimed and completed (deleted); every bulk row was written once.
        assert rows == {"bulk": ENGINES * ROUNDS * BULK}
    finally:
        direct.dispose()
        with psycopg.connect(chaos_server.url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
