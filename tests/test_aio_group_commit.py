"""Grouped commits in the asyncio worker's lease mode (sa_jobqueue/aio/group.py),
on both async drivers: the jobs of ``group_commit`` tasks with an ``async def``
handler share transactions, and each job's writes still commit exactly once
with its completion, whatever goes wrong in its group (a handler raises, the
flush fails, a deadline passes, a cancel is asked for, the fence refuses a
completion, the worker stops, the session's checkout stalls); a group holds
one session of ``max_sessions``; a sync handler that takes a session still
runs one job per transaction."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from uuid import uuid4

import pytest
from jobapp import Ledger, TaskJob
from sqlalchemy import Engine, event, func, select, text, update
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool
from tcpproxy import TcpProxy
from test_aio_watchdog import _client_port
from test_watchdog import _upstream
from waiting import wait_for_async

from sa_jobqueue import TaskRegistry, WorkerResult
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker

pytestmark = pytest.mark.anyio

jobs = AsyncJobRepository(TaskJob)
COUNT = 20


@pytest.fixture
def sessions(async_engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(async_engine, expire_on_commit=False)




async def _enqueue(sessions: async_sessionmaker[AsyncSession], task: str, n: int = COUNT) -> list[int]:
    async with sessions.begin() as session:
        return [(await jobs.enqueue(session, task)).id for _ in range(n)]


def _ledger(engine: Engine) -> dict[int, str | None]:
    with Session(engine) as session:
        return {row.job_id: row.note for row in session.scalars(select(Ledger))}


def _row(engine: Engine, job_id: int) -> TaskJob | None:
    with Session(engine) as session:
        return session.get(TaskJob, job_id)


def _worker(bind: Any, registry: TaskRegistry, **options: Any) -> AsyncWorker:
    options = {"concurrency": 2, "batch_size": COUNT, "listen": False, "poll_interval": 0.05, **options}
    return AsyncWorker(bind, jobs, registry, **options)


async def _drain(worker: AsyncWorker) -> WorkerResult:
    return await asyncio.wait_for(worker.run(until_empty=True, handle_signals=False), 60)




@contextmanager
def _commits(async_engine: AsyncEngine) -> Iterator[list[int]]:
    """The COMMITs of the jobs' sessions (the worker's own statements run in
    autocommit on an engine of its own, which this does not see)."""
    count = [0]

    def committed(conn: object) -> None:
        count[0] += 1

    event.listen(async_engine.sync_engine, "commit", committed)
    try:
        yield count
    finally:
        event.remove(async_engine.sync_engine, "commit", committed)


def _grouped(registry: TaskRegistry, runs: Counter[int], fail: set[int] = frozenset(), **options: Any) -> None:
    """``write``: a ledger row noting its transaction; raises for the ids in ``fail``."""

    @registry.task(group_commit=True, max_attempts=1, **options)
    async def write(job: TaskJob, session: AsyncSession) -> None:
        runs[job.id] += 1
        if job.id in fail:
            raise ValueError(f"job {job.id} fails")
        txid = await session.scalar(text("SELECT txid_current()"))
        session.add(Ledger(job_id=job.id, note=str(txid)))


def _pending_unspent(engine: Engine, ids: list[int]) -> bool:
    """Whether the jobs ``ids`` are all pending again, unowned, their attempt not spent (handed back)."""
    with Session(engine) as session:
        rows = session.scalars(select(TaskJob).where(TaskJob.id.in_(ids))).all()
    return len(rows) == len(ids) and all(
        r.status == "pending" and r.attempts == 0 and r.locked_by is None for r in rows)


# -- the groups ---------------------------------------------------------------------


async def test_grouped_jobs_share_transactions_and_each_commits_once(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry, runs = TaskRegistry(), Counter[int]()
    _grouped(registry, runs)
    ids = await _enqueue(sessions, "write")
    with _commits(async_engine) as commits:
        result = await _drain(_worker(async_engine, registry))
    assert result.completed == COUNT and result.dead == result.lost == 0
    ledger = _ledger(engine)
    assert sorted(ledger) == ids and set(runs.values()) == {1}
    assert len(set(ledger.values())) == 2  # two slots, one group (and one transaction) each
    assert commits[0] == 2
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0  # completed with them


async def test_a_sync_grouped_handler_runs_one_job_per_transaction_in_a_thread(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()

    @registry.task(group_commit=True)
    def write_sync(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id, note=str(session.scalar(text("SELECT txid_current()")))))

    ids = await _enqueue(sessions, "write_sync")
    result = await _drain(_worker(async_engine, registry, sync_bind=engine))
    assert result.completed == COUNT
    ledger = _ledger(engine)
    assert sorted(ledger) == ids and len(set(ledger.values())) == COUNT


async def test_a_failing_handler_is_recorded_alone_and_the_others_commit_once(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry, runs = TaskRegistry(), Counter[int]()
    ids = await _enqueue(sessions, "write")
    bad = {ids[5], ids[15]}  # one in each slot's group of ten
    _grouped(registry, runs, fail=bad)
    result = await _drain(_worker(async_engine, registry))
    assert (result.completed, result.dead) == (COUNT - 2, 2)
    assert sorted(_ledger(engine)) == sorted(set(ids) - bad)
    for job_id in bad:
        row = _row(engine, job_id)
        assert row is not None and row.status == "dead" and f"job {job_id} fails" in (row.last_error or "")
    assert all(runs[i] == 1 for i in bad)  # the one to blame is not run again
    assert [runs[i] for i in ids[:5] + ids[10:15]] == [2] * 10  # ran in the group, rolled back with it, then alone
    assert [runs[i] for i in ids[6:10] + ids[16:]] == [1] * 8  # after the culprit: alone, once


async def test_a_flush_failure_rolls_the_group_back_and_each_job_runs_alone(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    """A write that fails only at the group's flush has no handler to blame
    yet: every job of the group runs again alone, where the culprit's own flush fails."""
    registry, runs = TaskRegistry(), Counter[int]()
    ids = await _enqueue(sessions, "write")
    async with sessions.begin() as session:
        session.add(Ledger(job_id=ids[3], note="taken"))  # job 3's insert will violate the primary key

    @registry.task(group_commit=True, max_attempts=1)
    async def write(job: TaskJob, session: AsyncSession) -> None:
        runs[job.id] += 1
        session.add(Ledger(job_id=job.id, note="job"))

    result = await _drain(_worker(async_engine, registry))
    assert (result.completed, result.dead) == (COUNT - 1, 1)
    ledger = _ledger(engine)
    assert sorted(ledger) == ids and ledger[ids[3]] == "taken"
    row = _row(engine, ids[3])
    assert row is not None and row.status == "dead" and "IntegrityError" in (row.last_error or "")
    assert [runs[i] for i in ids[:10]] == [2] * 10  # its group's: rolled back at the flush, then each alone
    assert [runs[i] for i in ids[10:]] == [1] * 10  # the other group committed


async def test_a_deadline_in_a_group_settles_that_job_and_reruns_the_others(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    """The deadline cancels the group's coroutine and its statement on the
    server: that job times out, nobody else is blamed, the others commit once."""
    registry, runs = TaskRegistry(), Counter[int]()
    ids = await _enqueue(sessions, "write", 6)
    slow = ids[2]

    @registry.task(group_commit=True, max_attempts=1, timeout=timedelta(seconds=1))
    async def write(job: TaskJob, session: AsyncSession) -> None:
        runs[job.id] += 1
        if job.id == slow:
            await session.execute(text("SELECT pg_sleep(60)"))
        session.add(Ledger(job_id=job.id, note="job"))

    result = await _drain(_worker(async_engine, registry, concurrency=1, batch_size=6))  # 60 s did not run out
    assert (result.completed, result.dead) == (5, 1)
    assert sorted(_ledger(engine)) == sorted(set(ids) - {slow})
    row = _row(engine, slow)
    assert row is not None and row.status == "dead" and row.last_error == "timed out after 1 s"
    assert runs[slow] == 1
    assert [runs[i] for i in ids[:2]] == [2, 2] and [runs[i] for i in ids[3:]] == [1, 1, 1]

    def sleeping() -> int:
        with engine.connect() as conn:
            return int(conn.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(60)' AND state = 'active'"
            )) or 0)

    await wait_for_async(lambda: sleeping() == 0, 30, "the server to end the group's statement")


async def test_a_cancel_asked_for_in_a_group_ends_that_job_cancelled_and_the_others_commit(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry, runs = TaskRegistry(), Counter[int]()
    ids = await _enqueue(sessions, "write", 6)
    victim = ids[1]

    @registry.task(group_commit=True, max_attempts=1)
    async def write(job: TaskJob, session: AsyncSession) -> None:
        runs[job.id] += 1
        if job.id == victim:
            async with sessions.begin() as other:  # another process's cancel
                assert await jobs.cancel(other, job.id)
            await asyncio.sleep(60)  # cancelled when the worker learns of it, at its next heartbeat
        session.add(Ledger(job_id=job.id, note="job"))

    result = await _drain(_worker(async_engine, registry, concurrency=1, batch_size=6,
                                  heartbeat_interval=timedelta(seconds=0.5)))
    assert (result.completed, result.cancelled) == (5, 1)
    assert sorted(_ledger(engine)) == sorted(set(ids) - {victim})
    row = _row(engine, victim)
    assert row is not None and row.status == "cancelled"
    assert runs[victim] == 1 and runs[ids[0]] == 2 and [runs[i] for i in ids[2:]] == [1] * 4


async def test_a_lost_lease_in_a_group_loses_that_job_only(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    """The fence refuses one job of the group (another worker took it over):
    its writes never commit; the others run again and commit once."""
    registry, runs = TaskRegistry(), Counter[int]()
    ids = await _enqueue(sessions, "write", 6)
    stolen = ids[4]

    @registry.task(group_commit=True)
    async def write(job: TaskJob, session: AsyncSession) -> None:
        runs[job.id] += 1
        if job.id == stolen and runs[job.id] == 1:
            async with sessions.begin() as other:  # as a reap and a new claim by another worker would
                await other.execute(update(TaskJob).where(TaskJob.id == job.id)
                                    .values(lock_token=uuid4(), locked_by="other"))
        session.add(Ledger(job_id=job.id, note="job"))

    result = await _drain(_worker(async_engine, registry, concurrency=1, batch_size=6))
    assert (result.completed, result.lost) == (5, 1)
    assert sorted(_ledger(engine)) == sorted(set(ids) - {stolen})
    assert runs[stolen] == 1 and [runs[i] for i in ids if i != stolen] == [2] * 5
    row = _row(engine, stolen)
    assert row is not None and row.status == "running" and row.locked_by == "other"  # the other worker's now


# -- sessions ---------------------------------------------------------------------


async def test_a_group_holds_one_session_of_max_sessions(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    """With max_sessions=1 the claim's twenty grouped jobs make one group, run
    beside ungrouped jobs that take a session: never more than one session at
    once, and the group's jobs run again alone after a failure (the group's
    session given back first: else they would wait for it for ever)."""
    registry, runs = TaskRegistry(), Counter[int]()
    grouped = await _enqueue(sessions, "write")
    alone = await _enqueue(sessions, "by_itself", 10)
    _grouped(registry, runs, fail={grouped[7]})

    @registry.task
    async def by_itself(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="alone"))

    out, most = [0], [0]

    def checkout(*args: object) -> None:
        out[0] += 1

    def checkin(*args: object) -> None:
        most[0] = max(most[0], out[0])  # how many were out while this one was
        out[0] -= 1

    def detach(*args: object) -> None:
        # The worker's own engine connects through a copy of this pool, with
        # its listeners, and detaches each connection at once (no await
        # between): not a session's, and never counted.
        out[0] -= 1

    pool = async_engine.sync_engine.pool
    listeners: list[tuple[str, Callable[..., None]]] = [("checkout", checkout), ("checkin", checkin),
                                                          ("detach", detach)]
    for name, listener in listeners:
        event.listen(pool, name, listener)
    try:
        result = await _drain(_worker(async_engine, registry, concurrency=4, batch_size=30, max_sessions=1))
    finally:
        for name, listener in listeners:
            event.remove(pool, name, listener)
    assert (result.completed, result.dead) == (29, 1)
    assert sorted(_ledger(engine)) == sorted(set(grouped + alone) - {grouped[7]})
    assert most[0] == 1
    assert [runs[i] for i in grouped[:7]] == [2] * 7 and [runs[i] for i in grouped[7:]] == [1] * 13


# -- stopping ----------------------------------------------------------------------


async def test_a_stop_in_a_group_commits_what_ran_and_hands_back_the_rest(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry, worker, ran = TaskRegistry(), [], []
    ids = await _enqueue(sessions, "write", 5)

    @registry.task(group_commit=True)
    async def write(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="job"))
        ran.append(job.id)
        if len(ran) == 2:
            worker[0].stop()  # the group runs no further handler

    # By the handlers' count, not by id: two claims in flight may split the
    # five jobs between them, and so between groups, in any order.
    worker.append(_worker(async_engine, registry, concurrency=1, batch_size=5))
    with _commits(async_engine) as commits:
        result = await asyncio.wait_for(worker[0].run(handle_signals=False), 60)
    assert (result.completed, result.handed_back) == (2, 3)
    assert sorted(_ledger(engine)) == sorted(ran)
    assert commits[0] <= 2  # the two that ran, in their group's transaction (one per group that ran)
    assert _pending_unspent(engine, [i for i in ids if i not in ran])


async def test_past_the_shutdown_timeout_a_group_records_its_running_job_interrupted_and_hands_back_the_others(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine,
    running: list[asyncio.Task[Any]],
) -> None:
    """The job whose handler runs at the interrupt records an interrupted
    attempt; the group's others, those that ran (rolled back with it) and
    those that did not, are handed back: none of their writes committed."""
    registry, started = TaskRegistry(), asyncio.Event()
    ids = await _enqueue(sessions, "write", 5)

    @registry.task(group_commit=True)
    async def write(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="job"))
        if job.id == ids[2]:
            await session.flush()
            started.set()
            await asyncio.sleep(3600)

    worker = _worker(async_engine, registry, concurrency=1, batch_size=5, shutdown_timeout=0.3)
    task = asyncio.get_running_loop().create_task(worker.run(handle_signals=False))
    running.append(task)
    await asyncio.wait_for(started.wait(), 60)
    worker.stop()
    result = await asyncio.wait_for(task, 60)
    assert (result.retried, result.handed_back, result.completed) == (1, 4, 0)
    row = _row(engine, ids[2])
    assert row is not None and row.status == "pending" and row.attempts == 1 and row.locked_by is None
    assert row.last_error is not None and row.last_error.startswith("interrupted: the worker")
    assert _pending_unspent(engine, ids[:2] + ids[3:])
    assert _ledger(engine) == {}


async def test_a_group_whose_session_checkout_stalls_is_handed_back_whole(
    db_url: URL, async_driver: str, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """As tests/test_aio_watchdog.py's single job: the app's pool holds one
    connection, pre-pinged at checkout, which goes half-open once a first job
    ran on it. The group's checkout stalls in the ping: the lease mode gives
    up on it after ``stall_timeout``, the whole group is handed back
    unstarted, and its next run, on a new connection, commits each job once."""
    with TcpProxy(_upstream(db_url)) as proxy:
        app = create_async_engine(db_url.set(drivername=f"postgresql+{async_driver}", host="127.0.0.1",
                                             port=proxy.port, query={}), pool_size=1, max_overflow=0,
                                  pool_pre_ping=True)
        try:
            sessions = async_sessionmaker(app, expire_on_commit=False)
            registry, runs, ports = TaskRegistry(), list[tuple[int, int]](), list[int]()

            @registry.task(group_commit=True)
            async def write(job: TaskJob, session: AsyncSession) -> None:
                runs.append((job.id, job.attempts))
                ports.append(await _client_port(session))
                session.add(Ledger(job_id=job.id))

            (first,) = await _enqueue(sessions, "write", 1)
            worker = _worker(sessions, registry, concurrency=1, batch_size=4, stall_timeout=timedelta(seconds=1),
                             shutdown_timeout=timedelta(seconds=5))
            with caplog.at_level(logging.INFO, logger="sa_jobqueue.worker"):
                run = asyncio.ensure_future(worker.run(handle_signals=False))
                try:
                    await wait_for_async(lambda: first in _ledger(engine), 60, "the first job to complete")
                    assert proxy.half_open(client_ports={ports[0]}) == 1  # the pooled connection
                    async with async_sessionmaker(create_async_engine(db_url, poolclass=NullPool)).begin() as s:
                        group = [(await jobs.enqueue(s, "write")).id for _ in range(4)]
                    await wait_for_async(lambda: set(group) <= set(_ledger(engine)), 60,
                                 "the group to complete on a new connection")
                finally:
                    worker.stop()
                    await asyncio.wait_for(run, 30)
            assert runs == [(first, 1)] + [(i, 1) for i in group]  # handed back unstarted: no attempt spent
            assert len(set(ports)) == 2
            assert worker.result.handed_back == 4 and worker.result.completed == 5
            assert any(f"a group's 4 job(s) handed back unstarted (its session was given up on while connecting): "
                       f"{', '.join(map(str, group))}" in r.getMessage() for r in caplog.records)
        finally:
            proxy.stop()
            await app.dispose()
