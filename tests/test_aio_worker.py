"""AsyncWorker (sa_jobqueue.aio), on both async drivers: async and sync
handlers, the job's AsyncSession committing exactly once with the fenced
completion, batched completions, deadlines and cancels that cancel the
coroutine (and its statement), graceful and immediate stops, wake-ups by
NOTIFY, heartbeats, periodic jobs, logs with job context, bad options."""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
from jobapp import Ledger, TaskJob
from sqlalchemy import Engine, delete, func, select, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session
from waiting import wait_for_async

from sa_jobqueue import InvalidArgumentError, RetryPolicy, TaskRegistry, Worker, create_periodic_table, signals
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker
from sa_jobqueue.default import Job
from sa_jobqueue.logs import JobLogFilter
from sa_jobqueue.periodic import PERIODIC
from sa_jobqueue.urls import psycopg_url

pytestmark = pytest.mark.anyio

jobs = AsyncJobRepository(TaskJob)


@pytest.fixture
def sessions(async_engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(async_engine, expire_on_commit=False)


async def _enqueue(sessions: async_sessionmaker[AsyncSession], task: str, n: int = 1, **options: Any) -> list[int]:
    async with sessions.begin() as session:
        return [(await jobs.enqueue(session, task, **options)).id for _ in range(n)]


def _statuses(engine: Engine) -> dict[str, int]:
    with Session(engine) as session:
        rows = session.execute(select(TaskJob.status, func.count()).group_by(TaskJob.status)).all()
    return {status: int(count) for status, count in rows}


def _row(engine: Engine, job_id: int) -> TaskJob | None:
    with Session(engine) as session:
        return session.get(TaskJob, job_id)


def _ledger(engine: Engine) -> list[int]:
    with Session(engine) as session:
        return sorted(session.scalars(select(Ledger.job_id)))






def _start(worker: AsyncWorker, running: list[asyncio.Task[Any]]) -> asyncio.Task[Any]:
    task = asyncio.get_running_loop().create_task(worker.run(handle_signals=False))
    running.append(task)
    return task


# -- handlers and their sessions ---------------------------------------------------


async def test_async_and_sync_handlers_run_and_session_writes_commit_exactly_once_with_the_completion(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()
    in_threads: set[str] = set()

    @registry.task
    async def plain(job: TaskJob) -> None:
        await asyncio.sleep(0.01)

    @registry.task
    async def writes(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="async"))

    @registry.task
    def sync_plain(job: TaskJob) -> None:
        in_threads.add(threading.current_thread().name)

    @registry.task
    def sync_writes(job: TaskJob, session: Session) -> None:
        assert isinstance(session, Session)
        session.add(Ledger(job_id=job.id, note="sync"))

    written = await _enqueue(sessions, "writes", 30) + await _enqueue(sessions, "sync_writes", 10)
    await _enqueue(sessions, "plain", 30)
    await _enqueue(sessions, "sync_plain", 10)
    worker = AsyncWorker(async_engine, jobs, registry, concurrency=20, threads=2, sync_bind=engine, listen=False,
                         poll_interval=0.05)
    result = await worker.run(until_empty=True)
    assert result.completed == 80 and result.retried == result.dead == result.lost == 0
    assert _statuses(engine) == {}  # the table keeps no finished jobs
    assert _ledger(engine) == sorted(written)
    assert in_threads and all(name.startswith("sa_jobqueue-sync") for name in in_threads)


async def test_a_failing_async_handler_rolls_back_its_writes_and_retries_then_goes_dead(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()

    @registry.task(max_attempts=2, retry=RetryPolicy(base=timedelta(0), jitter=0.0))
    async def fails(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id))
        await session.flush()
        raise ValueError(f"attempt {job.attempts}")

    (job_id,) = await _enqueue(sessions, "fails")
    result = await AsyncWorker(async_engine, jobs, registry, listen=False, poll_interval=0.05).run(until_empty=True)
    assert result.retried == 1 and result.dead == 1 and result.completed == 0
    row = _row(engine, job_id)
    assert row is not None and row.status == "dead" and row.attempts == 2
    assert row.last_error is not None and "ValueError: attempt 2" in row.last_error
    assert _ledger(engine) == []


async def test_a_sync_handler_that_takes_a_session_needs_a_sync_bind(async_engine: AsyncEngine) -> None:
    registry = TaskRegistry()

    @registry.task
    def sync_writes(job: TaskJob, session: Session) -> None:
        pass

    with pytest.raises(InvalidArgumentError) as raised:
        AsyncWorker(async_engine, jobs, registry)
    assert raised.value.parameter == "sync_bind" and "sync_writes" in str(raised.value)


async def test_the_thread_worker_refuses_a_registry_with_async_handlers(engine: Engine) -> None:
    registry = TaskRegistry()

    @registry.task
    async def send(job: TaskJob) -> None:
        pass

    with pytest.raises(InvalidArgumentError) as raised:
        Worker(engine, jobs.sync, registry)
    assert raised.value.parameter == "tasks" and "AsyncWorker" in str(raised.value) and "send" in str(raised.value)


@pytest.mark.parametrize(("option", "value"), [
    ("concurrency", 0), ("threads", 0), ("max_sessions", -1), ("queues", ""), ("poll_interval", -1.0),
    ("shutdown_timeout", -1), ("job_timeout", 0), ("sync_bind", "postgresql://"), ("batch_size", 0),
])
async def test_bad_options_raise_naming_the_option(async_engine: AsyncEngine, option: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        AsyncWorker(async_engine, jobs, TaskRegistry(), **{option: value})
    assert raised.value.parameter == option


async def test_bad_binds_and_repositories_raise_naming_them(engine: Engine, async_engine: AsyncEngine) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        AsyncWorker(engine, jobs, TaskRegistry())  # type: ignore[arg-type]
    assert raised.value.parameter == "bind"
    with pytest.raises(InvalidArgumentError) as raised:
        AsyncWorker(async_sessionmaker(), jobs, TaskRegistry())
    assert raised.value.parameter == "bind"
    with pytest.raises(InvalidArgumentError) as raised:
        AsyncWorker(async_engine, [], TaskRegistry())
    assert raised.value.parameter == "repositories"
    with pytest.raises(InvalidArgumentError) as raised:
        AsyncWorker(async_engine, jobs, {})  # type: ignore[arg-type]
    assert raised.value.parameter == "tasks"


# -- deadlines and cancels -----------------------------------------------------------


async def test_a_deadline_cancels_the_coroutine_and_its_statement_and_nothing_commits(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()
    ended: list[str] = []

    @registry.task(timeout=0.5, max_attempts=1)
    async def slow(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id))
        await session.flush()
        try:
            await session.execute(text("SELECT pg_sleep(60)"))
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    (job_id,) = await _enqueue(sessions, "slow")
    result = await AsyncWorker(async_engine, jobs, registry, listen=False, poll_interval=0.05).run(until_empty=True)
    assert ended == ["cancelled"]
    assert result.dead == 1 and result.completed == 0
    row = _row(engine, job_id)
    assert row is not None and row.status == "dead" and row.last_error == "timed out after 0.5 s"
    assert _ledger(engine) == []

    def sleeping() -> int:
        with engine.connect() as conn:
            return int(conn.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(60)' AND state = 'active'"
            )) or 0)

    await wait_for_async(lambda: sleeping() == 0, 30, "the server to end the job's statement")


async def test_a_cancel_from_another_process_cancels_the_coroutine_and_its_writes_never_commit(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine,
    running: list[asyncio.Task[Any]],
) -> None:
    registry = TaskRegistry()
    started = asyncio.Event()
    seen: list[str] = []

    @registry.task
    async def waits(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id))
        await session.flush()
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    (job_id,) = await _enqueue(sessions, "waits")
    worker = AsyncWorker(async_engine, jobs, registry, poll_interval=0.05, heartbeat_interval=timedelta(seconds=30))
    task = _start(worker, running)
    await asyncio.wait_for(started.wait(), 60)
    with Session(engine) as session, session.begin():  # another process's cancel: a commit and its NOTIFY
        assert jobs.sync.cancel(session, job_id) is True
    await wait_for_async(lambda: (_row(engine, job_id) or TaskJob()).status == "cancelled", 60,
                         "the job to end cancelled")
    worker.stop()
    result = await asyncio.wait_for(task, 60)
    assert seen == ["cancelled"] and result.cancelled == 1 and result.completed == 0
    assert _ledger(engine) == []


# -- stopping ----------------------------------------------------------------------


async def test_a_stop_hands_back_unstarted_jobs_and_lets_running_ones_finish(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine,
    running: list[asyncio.Task[Any]],
) -> None:
    registry = TaskRegistry()
    started: list[int] = []
    release = asyncio.Event()

    @registry.task
    async def gated(job: TaskJob, session: AsyncSession) -> None:
        started.append(job.id)
        await release.wait()
        session.add(Ledger(job_id=job.id))

    ids = await _enqueue(sessions, "gated", 6)
    # Claims of 6 into 2 slots: four claimed jobs wait, unstarted.
    worker = AsyncWorker(async_engine, jobs, registry, concurrency=2, batch_size=6, listen=False, poll_interval=0.05)
    task = _start(worker, running)
    await wait_for_async(lambda: len(started) == 2, 60, "two jobs to start")
    worker.stop()
    await wait_for_async(lambda: _statuses(engine).get("pending") == 4, 60, "the unstarted jobs to be handed back")
    release.set()
    result = await asyncio.wait_for(task, 60)
    assert result.completed == 2 and result.handed_back == 4
    assert _ledger(engine) == sorted(started)
    with Session(engine) as session:
        pending = session.scalars(select(TaskJob).where(TaskJob.status == "pending")).all()
    assert sorted(j.id for j in pending) == sorted(set(ids) - set(started))
    assert all(j.attempts == 0 and j.locked_by is None for j in pending)  # their attempt not spent


def _endless() -> tuple[TaskRegistry, asyncio.Event]:
    """A registry whose task ``endless`` writes a ledger row, sets the event and waits for an hour."""
    registry = TaskRegistry()
    started = asyncio.Event()

    @registry.task
    async def endless(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id))
        await session.flush()
        started.set()
        await asyncio.sleep(3600)

    return registry, started


async def test_past_the_shutdown_timeout_running_coroutines_are_cancelled_and_their_attempt_recorded(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine,
    running: list[asyncio.Task[Any]],
) -> None:
    registry, started = _endless()
    (job_id,) = await _enqueue(sessions, "endless")
    worker = AsyncWorker(async_engine, jobs, registry, listen=False, poll_interval=0.05, shutdown_timeout=0.3)
    task = _start(worker, running)
    await asyncio.wait_for(started.wait(), 60)
    worker.stop()
    result = await asyncio.wait_for(task, 60)
    assert result.retried == 1 and result.completed == 0
    row = _row(engine, job_id)
    assert row is not None and row.status == "pending" and row.attempts == 1 and row.locked_by is None
    assert row.last_error is not None and row.last_error.startswith("interrupted: the worker")
    assert _ledger(engine) == []


async def test_a_stop_now_returns_without_waiting_and_commits_nothing(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine,
    running: list[asyncio.Task[Any]],
) -> None:
    registry, started = _endless()
    (job_id,) = await _enqueue(sessions, "endless")
    worker = AsyncWorker(async_engine, jobs, registry, listen=False, poll_interval=0.05, shutdown_timeout=3600)
    task = _start(worker, running)
    await asyncio.wait_for(started.wait(), 60)
    worker.stop()
    worker.stop(now=True)
    result = await asyncio.wait_for(task, 60)
    assert result.completed == 0
    row = _row(engine, job_id)
    assert row is not None and row.status == "running"  # left to its lease
    assert _ledger(engine) == []


# -- wake-ups, heartbeats, periodic jobs, logs and signals -------------------------


async def test_a_notify_wakes_an_idle_worker_long_before_its_poll(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine,
    running: list[asyncio.Task[Any]],
) -> None:
    registry = TaskRegistry()
    done = asyncio.Event()

    @registry.task
    async def ping(job: TaskJob) -> None:
        done.set()

    worker = AsyncWorker(async_engine, jobs, registry, poll_interval=600)
    _start(worker, running)
    # The listener LISTENs before the first probe settles; wait until its session is there.
    await wait_for_async(lambda: _listeners(engine) == 1, 60, "the worker's listener to LISTEN")
    await _enqueue(sessions, "ping")
    await asyncio.wait_for(done.wait(), 60)  # the poll is 10 minutes away: only the NOTIFY can do this
    worker.stop()


def _listeners(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'sa_jobqueue listener'"
        )) or 0)


async def test_heartbeats_keep_a_long_job_past_its_lease_and_it_completes_once(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()

    @registry.task
    async def long(job: TaskJob, session: AsyncSession) -> None:
        await asyncio.sleep(3.0)
        session.add(Ledger(job_id=job.id))

    (job_id,) = await _enqueue(sessions, "long")
    worker = AsyncWorker(async_engine, jobs, registry, listen=False, poll_interval=0.05,
                         lease=timedelta(seconds=1), heartbeat_interval=timedelta(seconds=0.2),
                         reap_interval=timedelta(seconds=0.2))
    result = await worker.run(until_empty=True)
    assert result.completed == 1 and result.lost == 0
    assert _ledger(engine) == [job_id]


async def test_periodic_jobs_are_enqueued_and_run(
    async_engine: AsyncEngine, engine: Engine, running: list[asyncio.Task[Any]]
) -> None:
    create_periodic_table(engine)
    registry = TaskRegistry()
    ran: list[int] = []

    @registry.periodic("* * * * * *")  # every second
    @registry.task
    async def tick(job: TaskJob) -> None:
        ran.append(job.id)

    worker = AsyncWorker(async_engine, jobs, registry, poll_interval=0.05, periodic_interval=0.1)
    task = _start(worker, running)
    await wait_for_async(lambda: len(ran) >= 1, 60, "a periodic tick to run")
    worker.stop()
    await asyncio.wait_for(task, 60)
    with engine.begin() as conn:
        conn.execute(delete(PERIODIC))


async def test_logs_written_in_a_handler_carry_its_job_and_signals_name_the_worker(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], caplog: pytest.LogCaptureFixture
) -> None:
    registry = TaskRegistry()
    log = logging.getLogger("tests.aio.handler")

    @registry.task
    async def talks(job: TaskJob) -> None:
        await asyncio.sleep(0.01)
        log.warning("working on %s", job.id)

    ids = await _enqueue(sessions, "talks", 5)
    filt = JobLogFilter()
    caplog.handler.addFilter(filt)
    seen: list[tuple[Any, str]] = []

    def succeeded(sender: Any, **extra: Any) -> None:
        seen.append((sender, extra["job"].task))

    signals.job_succeeded.connect(succeeded)
    try:
        worker = AsyncWorker(async_engine, jobs, registry, concurrency=5, listen=False, poll_interval=0.05)
        await worker.run(until_empty=True)
    finally:
        signals.job_succeeded.disconnect(succeeded)
        caplog.handler.removeFilter(filt)
    records = [r for r in caplog.records if r.name == "tests.aio.handler"]
    assert sorted(r.getMessage() for r in records) == sorted(f"working on {i}" for i in ids)
    assert all(r.getMessage() == f"working on {r.job_id}" for r in records)  # type: ignore[attr-defined]
    assert seen == [(worker, "talks")] * 5


async def test_async_handlers_take_an_async_callable_object(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    class Handler:
        async def __call__(self, job: TaskJob, session: AsyncSession) -> None:
            session.add(Ledger(job_id=job.id))

    registry = TaskRegistry()
    task = registry.register("callable", Handler())
    assert task.is_async and task.takes_session
    (job_id,) = await _enqueue(sessions, "callable")
    result = await AsyncWorker(async_engine, jobs, registry, listen=False, poll_interval=0.05).run(until_empty=True)
    assert result.completed == 1 and _ledger(engine) == [job_id]



# -- docs/asyncio.md ------------------------------------------------------------------


async def test_the_pages_worker_example_runs_its_handlers(default_table: tuple[str, Engine], async_driver: str) -> None:
    from test_docs import DOCS, python_blocks, section

    (code,) = python_blocks(section(DOCS / "asyncio.md", "## The asyncio worker"))
    shown = '"postgresql+asyncpg://app@db.internal/app"'
    assert code.count(shown) == 1
    libpq, engine = default_table
    url = psycopg_url(libpq).set(drivername=f"postgresql+{async_driver}")
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(code.replace(shown, repr(url.render_as_string(hide_password=False))), "docs/asyncio.md", "exec"),
         namespace)
    emails, example_engine = namespace["emails"], namespace["engine"]
    try:
        async with AsyncSession(example_engine) as session, session.begin():
            welcome = await emails.enqueue(session, "send_welcome", {"email": "ada@example.com"}, queue="signup")
        worker = AsyncWorker(example_engine, emails, namespace["tasks"], queues=["signup"], concurrency=100,
                             listen=False, poll_interval=0.05)
        result = await worker.run(until_empty=True)
    finally:
        await example_engine.dispose()
    assert result.completed == 2 and result.retried == result.dead == 0  # the welcome, then the ping it enqueued
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0
    assert welcome.id is not None


# -- the connection budget, sync deadlines, metrics -------------------------------------


async def test_jobs_holding_a_session_never_exceed_max_sessions(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()
    holding, most = [0], [0]

    @registry.task
    async def holds(job: TaskJob, session: AsyncSession) -> None:
        holding[0] += 1
        most[0] = max(most[0], holding[0])
        try:
            await asyncio.sleep(0.02)
            session.add(Ledger(job_id=job.id))
        finally:
            holding[0] -= 1

    ids = await _enqueue(sessions, "holds", 30)
    worker = AsyncWorker(async_engine, jobs, registry, concurrency=30, max_sessions=3, listen=False,
                         poll_interval=0.05)
    assert worker.max_sessions == 3
    result = await worker.run(until_empty=True)
    assert result.completed == 30 and _ledger(engine) == sorted(ids)
    assert most[0] == 3  # thirty in flight, three with a session at a time


async def test_a_job_whose_session_cannot_connect_is_handed_back_without_spending_an_attempt(
    db_url: URL, async_driver: str, engine: Engine, running: list[asyncio.Task[Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = create_async_engine(db_url.set(drivername=f"postgresql+{async_driver}"), pool_size=1, max_overflow=0,
                              pool_timeout=0.2)
    registry = TaskRegistry()
    attempts: list[int] = []

    @registry.task
    async def ledger(job: TaskJob, session: AsyncSession) -> None:
        attempts.append(job.attempts)
        session.add(Ledger(job_id=job.id))

    try:
        [job_id] = await _enqueue(async_sessionmaker(app, expire_on_commit=False), "ledger")
        leaked = await app.connect()  # the app's only connection, held elsewhere (a leaking handler)
        caplog.set_level(logging.ERROR, logger="sa_jobqueue.worker")
        worker = AsyncWorker(app, jobs, registry, concurrency=1, listen=False, poll_interval=0.05)
        task = _start(worker, running)
        await wait_for_async(lambda: worker.result.handed_back >= 2, 60, "the job to be handed back twice")
        exhausted = [r.getMessage() for r in caplog.records if "pool is exhausted" in r.getMessage()]
        # The pool's own count beside the worker's: the one checked out is held elsewhere.
        assert exhausted and all("Checked out connections: 1" in m and "running jobs hold 0 of them" in m
                                 and "held elsewhere" in m for m in exhausted), exhausted
        await leaked.close()
        await wait_for_async(lambda: _ledger(engine) == [job_id], 60, "the job to run once a connection is free")
        assert attempts == [1]  # handed back twice or more, yet its one run is its first attempt
        await wait_for_async(lambda: worker.result.completed == 1, 60, "the completion to be counted")
        worker.stop()
        await asyncio.wait_for(task, 60)  # its connections back in the pool before the pool goes
    finally:
        await app.dispose()


async def test_max_sessions_defaults_to_what_the_engines_pool_lends(async_engine: AsyncEngine) -> None:
    # SQLAlchemy's defaults: pool_size 5 + max_overflow 10.
    assert AsyncWorker(async_engine, jobs, TaskRegistry(), concurrency=100).max_sessions == 15
    assert AsyncWorker(async_engine, jobs, TaskRegistry(), concurrency=4).max_sessions == 4


async def test_a_sync_handlers_deadline_cancels_its_statement_and_its_late_return_commits_nothing(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    registry = TaskRegistry()

    @registry.task(timeout=0.5, max_attempts=1)
    def slow(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id))
        session.flush()
        session.execute(text("SELECT pg_sleep(60)"))  # cancelled on the server at the deadline

    (job_id,) = await _enqueue(sessions, "slow")
    worker = AsyncWorker(async_engine, jobs, registry, sync_bind=engine, listen=False, poll_interval=0.05)
    result = await asyncio.wait_for(worker.run(until_empty=True), 50)  # pg_sleep(60) did not run out
    assert result.dead == 1 and result.completed == 0
    row = _row(engine, job_id)
    assert row is not None and row.status == "dead" and row.last_error == "timed out after 0.5 s"
    assert _ledger(engine) == []


async def test_prometheus_counts_what_the_asyncio_worker_did(
    async_engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession]
) -> None:
    from prometheus_client import CollectorRegistry

    from sa_jobqueue.prometheus import JobMetrics

    registry = TaskRegistry()

    @registry.task
    async def fine(job: TaskJob) -> None:
        pass

    @registry.task(max_attempts=1)
    async def bad(job: TaskJob, session: AsyncSession) -> None:
        raise RuntimeError("no")

    await _enqueue(sessions, "fine", 3)
    await _enqueue(sessions, "bad")
    prom = CollectorRegistry()
    metrics = JobMetrics(prom).connect()
    try:
        await AsyncWorker(async_engine, jobs, registry, listen=False, poll_interval=0.05).run(until_empty=True)
    finally:
        metrics.disconnect()

    def value(name: str, **labels: str) -> float | None:
        return prom.get_sample_value(name, {"queue": "default", **labels})

    assert value("sa_jobqueue_jobs_started_total", task="fine") == 3
    assert value("sa_jobqueue_jobs_succeeded_total", task="fine") == 3
    assert value("sa_jobqueue_jobs_failed_total", task="bad", status="dead") == 1
