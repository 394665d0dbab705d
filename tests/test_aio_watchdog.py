"""The asyncio worker's watchdog (sa_jobqueue/aio/watchdog.py), on both async
drivers: it frees a statement stalled behind a half-open path on the
worker's own engine and on a job's connection while the job holds it (a
COMMIT included), never interrupts a statement the server is running, and
leaves the application's other connections alone; the lease mode gives up
on a job whose session stalls in the pool's checkout."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from jobapp import Ledger, TaskJob
from sqlalchemy import Engine, create_engine, event, select, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool
from tcpproxy import TcpProxy, local_port
from test_watchdog import _upstream

from sa_jobqueue import RetryPolicy, TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker
from sa_jobqueue.aio.bridge import in_greenlet
from sa_jobqueue.aio.watchdog import AsyncWatchdog
from sa_jobqueue.connections import driver_connect, worker_engine

pytestmark = pytest.mark.anyio

jobs = AsyncJobRepository(TaskJob)


@pytest.fixture
async def proxied(db_url: URL, async_driver: str) -> AsyncIterator[tuple[TcpProxy, AsyncEngine]]:
    """A TCP proxy in front of the test database, and an async app engine through it."""
    with TcpProxy(_upstream(db_url)) as proxy:
        app = create_async_engine(db_url.set(drivername=f"postgresql+{async_driver}", host="127.0.0.1",
                                             port=proxy.port, query={}))
        try:
            yield proxy, app
        finally:
            proxy.stop()  # first: frees whatever is still frozen, so that nothing below waits
            await app.dispose()


def _watchdog(app: AsyncEngine, **kwargs: Any) -> AsyncWatchdog:
    connect = driver_connect(app.sync_engine)
    return AsyncWatchdog(lambda: in_greenlet(connect), driver=app.dialect.driver, **kwargs)


async def _backend_exists(engine: Engine, pid: int) -> bool:
    def exists() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"),
                                     {"pid": pid}).scalar())
    return await asyncio.to_thread(exists)


async def _wait(predicate: Any, timeout: float, what: str) -> None:
    """Wait for the async ``predicate()`` to be true, up to ``timeout`` seconds."""
    async def poll() -> None:
        while not await predicate():
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(poll(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


async def test_a_stalled_statement_of_the_workers_engine_fails_and_its_backend_is_terminated(
    proxied: tuple[TcpProxy, AsyncEngine], engine: Engine
) -> None:
    proxy, app = proxied
    own = worker_engine(app.sync_engine, pool_size=2, name="watched")
    watchdog = _watchdog(app, after=1.0, interval=0.2)
    unwatch = watchdog.watch_engine(own)
    task = asyncio.get_running_loop().create_task(watchdog.run())

    def stalled() -> tuple[int, BaseException | None]:
        with own.connect() as conn:
            pid = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            assert proxy.half_open() == 1
            try:
                conn.execute(text("SELECT 2"))
            except DBAPIError as exc:
                assert exc.connection_invalidated
                return pid, exc
        return pid, None

    try:
        pid, error = await asyncio.wait_for(in_greenlet(stalled), 30)
    finally:
        task.cancel()
        unwatch()
        await in_greenlet(own.dispose)
    assert error is not None, "the stalled statement returned"
    assert watchdog.freed == 1
    # `engine` reaches the server directly. The backend was told to go; it exits when it gets to it.
    await _wait(lambda: _not(_backend_exists(engine, pid)), 30, "the terminated backend to exit")


async def _client_port(session: AsyncSession) -> int:
    """The local port of the session's connection, which the proxy sees as its client
    (the server cannot tell it: behind the proxy over a Unix socket it sees none)."""
    driver = (await (await session.connection()).get_raw_connection()).driver_connection
    if callable(getattr(driver, "fileno", None)):  # psycopg
        return local_port(driver.fileno())
    return int(driver._transport.get_extra_info("sockname")[1])  # asyncpg names no public accessor for its socket


async def _not(check: Any) -> bool:
    return not await check


async def test_a_long_statement_is_left_alone(proxied: tuple[TcpProxy, AsyncEngine]) -> None:
    _, app = proxied
    own = worker_engine(app.sync_engine, pool_size=2, name="watched")
    watchdog = _watchdog(app, after=0.3, interval=0.1)
    unwatch = watchdog.watch_engine(own)

    def long() -> int:
        with own.connect() as conn:
            conn.execute(text("SELECT 1"))
            return int(conn.execute(text("SELECT 7 FROM pg_sleep(2.5)")).scalar_one())

    task = asyncio.get_running_loop().create_task(watchdog.run())
    try:
        assert await asyncio.wait_for(in_greenlet(long), 30) == 7
    finally:
        task.cancel()
        unwatch()
        await in_greenlet(own.dispose)
    assert watchdog.looks > 0 and watchdog.freed == 0


async def test_a_jobs_connection_is_watched_while_the_job_holds_it(proxied: tuple[TcpProxy, AsyncEngine]) -> None:
    """``watch_jobs`` and ``watch_job``: a connection of the application's
    engine is watched from ``watch_job`` until its release; one released is
    not, nor any other."""
    proxy, app = proxied
    watchdog = _watchdog(app, after=1.0, interval=0.2)
    unwatch = watchdog.watch_jobs(app.sync_engine)
    async with app.connect() as held, app.connect() as released:
        for conn in (held, released):
            await conn.execute(text("SELECT 1"))
        watch = watchdog.watch_job(held, (await held.get_raw_connection()).driver_connection)
        watchdog.watch_job(released, (await released.get_raw_connection()).driver_connection).release()
        task = asyncio.get_running_loop().create_task(watchdog.run())
        try:
            assert proxy.half_open() == 2
            waiting = asyncio.ensure_future(released.execute(text("SELECT 1")))
            with pytest.raises(DBAPIError) as raised:
                await asyncio.wait_for(held.execute(text("SELECT 2")), 30)
            assert raised.value.connection_invalidated
            watch.release()
            looked = watchdog.looks
            await _wait(lambda: _true(watchdog.looks >= looked + 3), 30, "three more looks of the watchdog")
            assert not waiting.done() and watchdog.freed == 1
            proxy.stop()  # the unwatched statement's wait ends with the proxy
            with pytest.raises(DBAPIError):
                await asyncio.wait_for(waiting, 30)
        finally:
            task.cancel()
            unwatch()


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize("mode", ["lease", "transaction"])
async def test_a_jobs_commit_stalled_on_the_network_is_freed(
    proxied: tuple[TcpProxy, AsyncEngine], engine: Engine, mode: str
) -> None:
    """The COMMIT of the job's (or batch's) AsyncSession is in flight for
    the watchdog: the first run's COMMIT stalls (its backend's connection
    alone is frozen, in ``before_commit``); the watchdog ends it, nothing of
    that run commits, and the job runs again and completes. Unwatched, the
    COMMIT would wait forever and the job with it."""
    proxy, app = proxied
    ports: list[int] = []
    runs: list[int] = []
    frozen: list[int] = []

    class StallingSession(Session):
        pass

    @event.listens_for(StallingSession, "before_commit")
    def stall_the_first_commit(session: Session) -> None:
        # The COMMIT itself, not a RELEASE SAVEPOINT (transaction mode's per job).
        if ports and not frozen and not session.in_nested_transaction():
            frozen.append(proxy.half_open(client_ports={ports[0]}))

    sessions = async_sessionmaker(app, expire_on_commit=False, sync_session_class=StallingSession)
    registry = TaskRegistry()

    @registry.task(retry=RetryPolicy(base=timedelta(0), jitter=0.0))
    async def commit_stalls_once(job: TaskJob, session: AsyncSession) -> None:
        runs.append(job.id)
        ports.append(await _client_port(session))
        session.add(Ledger(job_id=job.id))

    async with sessions.begin() as session:
        job_id = (await jobs.enqueue(session, "commit_stalls_once")).id
    worker = AsyncWorker(sessions, jobs, registry, mode=mode, concurrency=1, poll_interval=0.05, listen=False,
                         stall_timeout=timedelta(seconds=1), shutdown_timeout=timedelta(seconds=5))
    running = asyncio.ensure_future(worker.run(handle_signals=False))

    def ledger_rows() -> int:
        with Session(engine) as s:
            return len(s.scalars(select(Ledger.job_id).where(Ledger.job_id == job_id)).all())

    try:
        await _wait(lambda: asyncio.to_thread(lambda: ledger_rows() == 1), 60,
                    "the job to complete after its stalled COMMIT was freed")
    finally:
        worker.stop()
        await asyncio.wait_for(running, 30)
    assert frozen == [1] and len(runs) == 2  # the stalled run committed nothing; the second did
    with Session(engine) as s:
        assert s.get(TaskJob, job_id) is None  # completed once


async def test_a_jobs_completion_stalled_on_the_network_is_freed(
    proxied: tuple[TcpProxy, AsyncEngine], engine: Engine
) -> None:
    """The fenced completion, which the worker sends straight through the
    driver (:mod:`sa_jobqueue.direct`), is in flight for the watchdog as
    SQLAlchemy's statements are: the handler writes nothing, so the first
    statement after its connection is frozen is the completion; the watchdog
    ends it, and the job runs again and completes. Unwatched, the completion
    would wait forever and the job with it."""
    proxy, app = proxied
    runs: list[int] = []
    frozen: list[int] = []
    registry = TaskRegistry()

    @registry.task(retry=RetryPolicy(base=timedelta(0), jitter=0.0))
    async def completion_stalls_once(job: TaskJob, session: AsyncSession) -> None:
        runs.append(job.id)
        port = await _client_port(session)
        if not frozen:
            frozen.append(proxy.half_open(client_ports={port}))

    async with AsyncSession(app) as session, session.begin():
        job_id = (await jobs.enqueue(session, "completion_stalls_once")).id
    worker = AsyncWorker(app, jobs, registry, concurrency=1, poll_interval=0.05, listen=False,
                         stall_timeout=timedelta(seconds=1), shutdown_timeout=timedelta(seconds=5))
    running = asyncio.ensure_future(worker.run(handle_signals=False))

    def completed() -> bool:
        with Session(engine) as s:
            return s.get(TaskJob, job_id) is None

    try:
        await _wait(lambda: asyncio.to_thread(completed), 60, "the job to complete after its stalled completion")
    finally:
        worker.stop()
        await asyncio.wait_for(running, 30)
    assert frozen == [1] and runs == [job_id, job_id]


@pytest.mark.parametrize("mode", ["lease", "transaction"])
async def test_a_session_stalled_in_the_pools_checkout_is_given_up_and_the_job_handed_back(
    db_url: URL, async_driver: str, engine: Engine, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """The app's pool holds one connection, pre-pinged at checkout. A first
    job runs on it; then that connection alone goes half-open, in the pool.
    The next job's checkout stalls in the ping (outside any statement the
    watchdog sees): the lease mode gives up on it after ``stall_timeout``,
    the job is handed back unstarted, and its next run, on a new
    connection, completes. In transaction mode the batch's session stalls
    before it claims: the batch is given up after ``stall_timeout`` (before,
    it waited forever, a slot lost, and the worker did not stop on time),
    and the next batch claims the job on a new connection."""
    with TcpProxy(_upstream(db_url)) as proxy:
        app = create_async_engine(db_url.set(drivername=f"postgresql+{async_driver}", host="127.0.0.1",
                                             port=proxy.port, query={}), pool_size=1, max_overflow=0,
                                  pool_pre_ping=True)
        try:
            sessions = async_sessionmaker(app, expire_on_commit=False)
            registry = TaskRegistry()
            runs: list[tuple[int, int]] = []
            ports: list[int] = []

            @registry.task
            async def write(job: TaskJob, session: AsyncSession) -> None:
                runs.append((job.id, job.attempts))
                ports.append(await _client_port(session))
                session.add(Ledger(job_id=job.id))

            frozen: list[int] = []

            @event.listens_for(app.sync_engine, "checkin")
            def freeze_in_the_pool(*args: object) -> None:
                # As the first job's connection is back in the pool, and before
                # another checkout (a transaction-mode probe) can take it.
                if ports and not frozen:
                    frozen.append(proxy.half_open(client_ports={ports[0]}))

            async with sessions.begin() as session:
                first = (await jobs.enqueue(session, "write")).id
            worker = AsyncWorker(sessions, jobs, registry, concurrency=1, poll_interval=0.05, listen=False,
                                 mode=mode, stall_timeout=timedelta(seconds=1),  # type: ignore[arg-type]
                                 shutdown_timeout=timedelta(seconds=5))
            with caplog.at_level(logging.ERROR, logger="sa_jobqueue.worker"):
                running = asyncio.ensure_future(worker.run(handle_signals=False))
                try:
                    await _wait(lambda: asyncio.to_thread(lambda: _completed(engine, first)), 60,
                                "the first job to complete")
                    assert frozen == [1]  # the pooled connection
                    async with async_sessionmaker(create_async_engine(db_url, poolclass=NullPool)).begin() as s:
                        second = (await jobs.enqueue(s, "write")).id
                    await _wait(lambda: asyncio.to_thread(lambda: _completed(engine, second)), 60,
                                "the second job to complete on a new connection")
                finally:
                    worker.stop()
                    await asyncio.wait_for(running, 30)
            assert runs == [(first, 1), (second, 1)]  # handed back unstarted: its attempt not spent
            assert len(set(ports)) == 2
            given_up = (f"job {second}'s session has waited 1 s for a connection; the job is handed back unstarted"
                        if mode == "lease" else
                        "a batch's session has waited 1 s for a connection; the batch is given up before it "
                        "claimed anything")
            assert any(given_up in r.getMessage() for r in caplog.records)
        finally:
            proxy.stop()
            await app.dispose()


def _completed(engine: Engine, job_id: int) -> bool:
    with Session(engine) as session:
        return session.get(TaskJob, job_id) is None and bool(
            session.scalars(select(Ledger.job_id).where(Ledger.job_id == job_id)).all())



async def test_the_workers_listeners_leave_the_applications_engine_when_it_stops(async_engine: AsyncEngine) -> None:
    """While it runs, the worker's statement listeners are on the
    application's engine; once it returns, none is left."""
    names = ("before_cursor_execute", "after_cursor_execute", "rollback")
    engine = async_engine.sync_engine
    seen: list[bool] = []
    registry = TaskRegistry()

    @registry.task
    async def look(job: TaskJob, session: AsyncSession) -> None:
        seen.append(all(len(getattr(engine.dispatch, name)) == 1 for name in names))

    sessions = async_sessionmaker(async_engine, expire_on_commit=False)
    async with sessions.begin() as session:
        await jobs.enqueue(session, "look")
    await AsyncWorker(sessions, jobs, registry, listen=False).run(until_empty=True, handle_signals=False)
    assert seen == [True]
    assert all(len(getattr(engine.dispatch, name)) == 0 for name in names)


async def test_a_sync_handlers_commit_stalled_on_the_network_is_freed(db_url: URL, async_engine: AsyncEngine,
                                                                      engine: Engine) -> None:
    """A sync handler that takes a session runs in a thread on ``sync_bind``:
    its connection is the thread watchdog's while it holds it. Its first
    COMMIT stalls (that connection alone frozen, in ``before_commit``); the
    watchdog ends it, nothing of that run commits, and the job runs again
    and completes."""
    with TcpProxy(_upstream(db_url)) as proxy:
        sync_app = create_engine(db_url.set(host="127.0.0.1", port=proxy.port, query={}))
        try:
            sync_sessions = sessionmaker(sync_app, expire_on_commit=False)
            ports: list[int] = []
            runs: list[int] = []
            frozen: list[int] = []

            @event.listens_for(sync_sessions, "before_commit")
            def stall_the_first_commit(session: Session) -> None:
                if ports and not frozen:
                    frozen.append(proxy.half_open(client_ports={ports[0]}))

            registry = TaskRegistry()

            @registry.task(retry=RetryPolicy(base=timedelta(0), jitter=0.0))
            def commit_stalls_once(job: TaskJob, session: Session) -> None:
                runs.append(job.id)
                ports.append(local_port(session.connection().connection.dbapi_connection.fileno()))  # type: ignore[union-attr]
                session.add(Ledger(job_id=job.id))

            sessions = async_sessionmaker(async_engine, expire_on_commit=False)
            async with sessions.begin() as session:
                job_id = (await jobs.enqueue(session, "commit_stalls_once")).id
            worker = AsyncWorker(sessions, jobs, registry, sync_bind=sync_sessions, concurrency=1,
                                 poll_interval=0.05, listen=False, stall_timeout=timedelta(seconds=1),
                                 shutdown_timeout=timedelta(seconds=5))
            running = asyncio.ensure_future(worker.run(handle_signals=False))
            try:
                await _wait(lambda: asyncio.to_thread(lambda: _completed(engine, job_id)), 60,
                            "the job to complete after its stalled COMMIT was freed")
            finally:
                worker.stop()
                await asyncio.wait_for(running, 30)
            assert frozen == [1] and runs == [job_id, job_id]  # the stalled run committed nothing
        finally:
            proxy.stop()
            sync_app.dispose()
