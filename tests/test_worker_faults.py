"""Faults the worker used to let through, each pinned by a test that failed
before its fix (see docs/reliability.md): bad RetryJob arguments, async
handlers, failing completion writes, deadlines, stuck threads, a job session
that cannot connect."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from jobapp import QUICK, Ledger, TaskJob, jobs
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker
from waiting import wait_for

from sa_jobqueue import InvalidArgumentError, JobSpec, RetryJob, TaskRegistry, Worker, WorkerStuckError

MODES = ["lease", "transaction"]


def _row(sessions: sessionmaker[Session], job_id: int) -> TaskJob | None:
    with sessions() as session:
        return session.get(TaskJob, job_id)


def _ledger(sessions: sessionmaker[Session]) -> list[int]:
    with sessions() as session:
        return sorted(session.scalars(select(Ledger.job_id)))


@pytest.fixture
def in_thread() -> Iterator[Callable[[Worker], threading.Thread]]:
    """Run a worker in a thread; it is stopped and joined at teardown."""
    running: list[tuple[Worker, threading.Thread]] = []

    def start(worker: Worker) -> threading.Thread:
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        running.append((worker, thread))
        return thread

    yield start
    for worker, thread in running:
        worker.stop(now=True)
        thread.join(60)


# -- 1. RetryJob with a bad argument -------------------------------------------------


def test_retry_job_checks_its_arguments_where_it_is_raised() -> None:
    with pytest.raises(InvalidArgumentError) as naive:
        RetryJob(at=datetime.now())
    assert naive.value.parameter == "at"
    for bad in (-1, timedelta(seconds=-1), float("nan"), "soon", True):
        with pytest.raises(InvalidArgumentError) as raised:
            RetryJob(delay=bad)  # type: ignore[arg-type]
        assert raised.value.parameter == "delay"
    with pytest.raises(InvalidArgumentError):
        RetryJob(delay=1, at=datetime.now().astimezone())
    assert RetryJob(delay=5).delay == timedelta(seconds=5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", ["naive at", "past the horizon"])
def test_a_bad_retry_request_counts_the_attempt_and_never_reruns_batch_mates(
    engine: Engine, sessions: sessionmaker[Session], mode: str, bad: str
) -> None:
    registry = TaskRegistry()
    runs: list[int] = []

    @registry.task(retry=QUICK, max_attempts=3)
    def bad_retry(job: TaskJob) -> None:
        runs.append(job.id)
        if bad == "naive at":
            raise RetryJob(at=datetime.now())  # raises InvalidArgumentError: the handler's failure
        raise RetryJob(delay=timedelta(days=365 * 200))  # valid here, refused by the database's horizon

    @registry.task
    def good(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id))

    with sessions.begin() as session:
        created = jobs.enqueue_many(session, [JobSpec("good"), JobSpec("bad_retry"), JobSpec("good"),
                                              JobSpec("good")])
    result = Worker(engine, jobs, registry, mode=mode, concurrency=1, batch_size=10, listen=False,
                    poll_interval=0.05).run(until_empty=True)
    bad_id = created[1].id
    assert runs == [bad_id] * 3  # three attempts, as many runs: the attempts counted
    assert _ledger(sessions) == sorted(j.id for j in created if j.task == "good")  # each batch-mate once
    row = _row(sessions, bad_id)
    assert row is not None and row.status == "dead" and row.attempts == 3
    assert row.last_error is not None and ("at" in row.last_error or "delay" in row.last_error)
    assert result.completed == 3 and result.dead == 1


# -- 2. async handlers -------------------------------------------------------------


def test_an_async_def_handler_registers_and_the_thread_worker_refuses_it_naming_the_asyncio_worker(
    engine: Engine,
) -> None:
    registry = TaskRegistry()

    async def send(job: Any) -> None:
        pass

    assert registry.register("send", send).is_async
    with pytest.raises(InvalidArgumentError) as raised:
        Worker(engine, jobs, registry)
    assert raised.value.parameter == "tasks" and "AsyncWorker" in str(raised.value)


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_that_returns_an_awaitable_fails_and_its_job_is_kept(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    registry = TaskRegistry()

    async def later(job: Any) -> None:
        raise AssertionError("never awaited")

    @registry.task(max_attempts=1)
    def wraps_async(job: TaskJob, session: Session) -> Any:
        return later(job)

    with sessions.begin() as session:
        job = jobs.enqueue(session, "wraps_async")
    result = Worker(engine, jobs, registry, mode=mode, concurrency=1, listen=False,
                    poll_interval=0.05).run(until_empty=True)
    assert result.completed == 0 and result.dead == 1
    row = _row(sessions, job.id)
    assert row is not None and row.status == "dead"
    assert row.last_error is not None and "awaitable" in row.last_error


def test_the_testing_helper_refuses_an_awaitable_too(sessions: sessionmaker[Session]) -> None:
    from sa_jobqueue.testing import run_enqueued

    registry = TaskRegistry()

    @registry.task
    def wraps_async(job: TaskJob) -> Any:
        return asyncio.sleep(0)

    with sessions() as session, session.begin():
        jobs.enqueue(session, "wraps_async")
        result = run_enqueued(session, jobs, registry, raise_errors=False)
        assert result.completed == [] and len(result.retried) == 1


# -- 3. a failing completion write backs off ---------------------------------------


def test_a_failing_completion_write_backs_off_and_loses_nothing(
    db_url: URL, engine: Engine, sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture,
    in_thread: Callable[[Worker], threading.Thread],
) -> None:
    role = "sajq_no_delete"
    with engine.begin() as conn:
        conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(text(f"GRANT SELECT, INSERT, UPDATE ON task_jobs TO {role}"))
    limited = create_engine(db_url.set(username=role))
    registry = TaskRegistry()

    @registry.task
    def sessionless(job: TaskJob) -> None:
        pass

    try:
        with sessions.begin() as session:
            jobs.enqueue_many(session, [JobSpec("sessionless") for _ in range(5)])
        caplog.set_level(logging.ERROR, logger="sa_jobqueue.worker")
        worker = Worker(limited, jobs, registry, concurrency=2, listen=False, poll_interval=0.05)
        in_thread(worker)

        def failures() -> list[float]:
            found = [re.search(r"next try in ([0-9.]+) s", r.getMessage()) for r in caplog.records]
            return [float(m.group(1)) for m in found if m]

        wait_for(lambda: len(failures()) >= 4, 60, "four failed completion writes")
        waits = failures()
        assert waits[:4] == [0.1, 0.2, 0.4, 0.8]  # doubling, one log line per try
        with engine.begin() as conn:
            conn.execute(text(f"GRANT DELETE ON task_jobs TO {role}"))
        wait_for(lambda: worker.result.completed == 5, 60, "the completions to be written")
        with sessions() as session:
            assert session.scalar(select(func.count()).select_from(TaskJob)) == 0
    finally:
        limited.dispose()
        with engine.begin() as conn:
            conn.execute(text(f"REVOKE ALL ON task_jobs FROM {role}"))


# -- 5. deadlines ---------------------------------------------------------------------


def test_a_job_past_its_deadline_fails_with_a_timeout_and_its_late_return_commits_nothing(
    engine: Engine, sessions: sessionmaker[Session], in_thread: Callable[[Worker], threading.Thread],
) -> None:
    registry = TaskRegistry()
    release = threading.Event()

    @registry.task(timeout=0.3, max_attempts=1)
    def overdue(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id))
        session.flush()
        release.wait(60)  # returns once the test has seen the timeout recorded

    with sessions.begin() as session:
        job = jobs.enqueue(session, "overdue")
    worker = Worker(engine, jobs, registry, concurrency=1, listen=False, poll_interval=0.05)
    thread = in_thread(worker)

    def dead() -> bool:
        row = _row(sessions, job.id)
        return row is not None and row.status == "dead"

    wait_for(dead, 60, "the job to time out")
    row = _row(sessions, job.id)
    assert row is not None and row.attempts == 1 and row.last_error == "timed out after 0.3 s"
    release.set()
    wait_for(lambda: worker.result.dead == 1, 60, "the timeout to be counted")
    worker.stop()
    thread.join(60)
    assert _ledger(sessions) == []  # the late return committed nothing
    assert worker.result.completed == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_deadline_cancels_the_jobs_statement_on_the_server(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    registry = TaskRegistry()
    errors: list[BaseException] = []

    @registry.task(timeout=timedelta(milliseconds=300), max_attempts=1)
    def sleeps_in_sql(job: TaskJob, session: Session) -> None:
        try:
            session.execute(text("SELECT pg_sleep(120)"))
        except BaseException as exc:
            errors.append(exc)
            raise

    with sessions.begin() as session:
        job = jobs.enqueue(session, "sleeps_in_sql")
    # until_empty returns only once the handler returned: the statement was cancelled.
    result = Worker(engine, jobs, registry, mode=mode, concurrency=1, listen=False, poll_interval=0.05,
                    shutdown_timeout=120).run(until_empty=True)
    assert result.dead == 1 and result.completed == 0
    assert errors and isinstance(getattr(errors[0], "orig", None), psycopg.errors.QueryCanceled)
    row = _row(sessions, job.id)
    assert row is not None and row.last_error == "timed out after 0.3 s"


@pytest.mark.parametrize("mode", MODES)
def test_the_worker_default_timeout_applies_to_tasks_without_one(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    registry = TaskRegistry()

    @registry.task(max_attempts=1)
    def sleeps(job: TaskJob, session: Session) -> None:
        session.execute(text("SELECT pg_sleep(120)"))

    with sessions.begin() as session:
        job = jobs.enqueue(session, "sleeps")
    result = Worker(engine, jobs, registry, mode=mode, concurrency=1, listen=False, poll_interval=0.05,
                    job_timeout=0.2).run(until_empty=True)
    assert result.dead == 1
    row = _row(sessions, job.id)
    assert row is not None and row.last_error == "timed out after 0.2 s"


def test_stuck_threads_are_replaced_and_past_the_limit_the_worker_gives_up(
    engine: Engine, sessions: sessionmaker[Session],
) -> None:
    registry = TaskRegistry()
    never = threading.Event()
    started: list[int] = []

    @registry.task(timeout=0.2, retry=QUICK, max_attempts=1)
    def stuck(job: TaskJob) -> None:
        started.append(job.id)
        never.wait(120)  # a Python-level hang: nothing to cancel on the server

    @registry.task
    def good(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id))

    with sessions.begin() as session:
        created = jobs.enqueue_many(session, [JobSpec("stuck"), JobSpec("good"), JobSpec("stuck"),
                                              JobSpec("good")])
    worker = Worker(engine, jobs, registry, concurrency=1, listen=False, poll_interval=0.05, max_stuck_slots=1)
    try:
        with pytest.raises(WorkerStuckError, match="max_stuck_slots=1"):
            worker.run()
    finally:
        never.set()
    # The first stuck thread was replaced: the jobs behind it ran.
    assert started == [created[0].id, created[2].id]
    assert created[1].id in _ledger(sessions)
    assert worker.result.dead == 2


def test_a_python_hang_in_transaction_mode_rolls_its_batch_back_and_replaces_the_thread(
    engine: Engine, sessions: sessionmaker[Session],
) -> None:
    registry = TaskRegistry()
    never = threading.Event()
    runs: list[int] = []

    @registry.task(timeout=0.2)
    def hangs(job: TaskJob, session: Session) -> None:
        runs.append(job.id)
        session.add(Ledger(job_id=job.id))
        session.flush()
        never.wait(120)

    with sessions.begin() as session:
        job = jobs.enqueue(session, "hangs")
    worker = Worker(engine, jobs, registry, mode="transaction", concurrency=1, listen=False, poll_interval=0.05,
                    max_stuck_slots=1)
    try:
        with pytest.raises(WorkerStuckError):
            worker.run()
    finally:
        never.set()
    assert runs == [job.id, job.id]  # its batch rolled back and ran again on a fresh thread

    def pending_again() -> bool:
        row = _row(sessions, job.id)
        return row is not None and row.status == "pending" and row.attempts == 0

    # The terminated backend's transaction ends asynchronously.
    wait_for(pending_again, 60, "the batch's transaction to roll back")
    assert _ledger(sessions) == []


# -- 10d. a job whose session cannot connect is handed back ---------------------------


def test_a_job_whose_session_cannot_connect_is_handed_back_without_spending_an_attempt(
    db_url: URL, sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture,
    in_thread: Callable[[Worker], threading.Thread],
) -> None:
    app = create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    registry = TaskRegistry()

    attempts: list[int] = []

    @registry.task
    def ledger(job: TaskJob, session: Session) -> None:
        attempts.append(job.attempts)
        session.add(Ledger(job_id=job.id))

    try:
        with sessions.begin() as session:
            job = jobs.enqueue(session, "ledger")
        leaked = app.connect()  # the app's only connection, held elsewhere (a leaking handler)
        caplog.set_level(logging.ERROR, logger="sa_jobqueue.worker")
        worker = Worker(app, jobs, registry, concurrency=1, listen=False, poll_interval=0.05)
        in_thread(worker)
        wait_for(lambda: worker.result.handed_back >= 2, 60, "the job to be handed back twice")
        assert any("pool is exhausted" in r.getMessage() for r in caplog.records)
        leaked.close()
        wait_for(lambda: _ledger(sessions) == [job.id], 60, "the job to run once a connection is free")
        assert attempts == [1]  # handed back twice or more, yet its one run is its first attempt
        wait_for(lambda: worker.result.completed == 1, 60, "the completion to be counted")
    finally:
        app.dispose()
