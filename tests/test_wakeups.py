"""LISTEN/NOTIFY: one NOTIFY per transaction and queue, listeners that wake idle workers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from jobapp import Ledger, TaskJob, jobs, tasks
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import JobRepository, JobSpec, TaskRegistry, Worker


@pytest.fixture
def listen(libpq_url: str) -> Iterator[Callable[[], list[tuple[str, str]]]]:
    """A raw listener on the task_jobs channel; call it to drain what arrived."""
    conn = psycopg.connect(libpq_url, autocommit=True)
    conn.execute(f'LISTEN "{jobs.channel}"')

    def drain() -> list[tuple[str, str]]:
        return [(n.channel, n.payload) for n in conn.notifies(timeout=0.5)]

    yield drain
    conn.close()


def test_one_notify_per_transaction_and_queue_at_commit(
    sessions: sessionmaker[Session], engine: Engine, listen: Callable[[], list[tuple[str, str]]]
) -> None:
    with recorded_sql(engine) as statements, sessions.begin() as session:
        jobs.enqueue(session, "noop", queue="a")
        jobs.enqueue(session, "noop", queue="a")
        jobs.enqueue_many(session, [JobSpec("noop", queue="a"), JobSpec("noop", queue="b")])
        jobs.enqueue(session, "noop", queue="c", delay=timedelta(hours=1))
        jobs.enqueue(session, "noop", queue="d", run_at=datetime.now(timezone.utc) + timedelta(hours=1))
        assert listen() == []  # nothing before commit
    assert sorted(listen()) == [(jobs.channel, "a"), (jobs.channel, "b")]
    # 'a' once, then 'b': never again for a notified queue.
    assert len([s for s in statements if "pg_notify" in s]) == 2
    with sessions.begin() as session:
        jobs.enqueue(session, "noop", queue="a")
    assert listen() == [(jobs.channel, "a")]  # a new transaction notifies again


def test_a_single_enqueue_folds_its_notify_into_the_insert(
    sessions: sessionmaker[Session], engine: Engine, listen: Callable[[], list[tuple[str, str]]]
) -> None:
    with recorded_sql(engine) as statements, sessions.begin() as session:
        jobs.enqueue(session, "noop", queue="a")
        jobs.enqueue(session, "noop", queue="a")
        jobs.enqueue(session, "noop", queue="b", delay=timedelta(hours=1))
    assert len(statements) == 3 and all(s.startswith("INSERT") for s in statements)
    assert ["pg_notify" in s for s in statements] == [True, False, False]
    assert listen() == [(jobs.channel, "a")]


def test_no_notify_on_rollback_or_when_disabled(
    sessions: sessionmaker[Session], listen: Callable[[], list[tuple[str, str]]]
) -> None:
    with sessions() as session:
        session.begin()
        jobs.enqueue(session, "noop")
        session.rollback()
    quiet = JobRepository(TaskJob, notify=False)
    with sessions.begin() as session:
        quiet.enqueue(session, "noop")
    assert listen() == []
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 1


@contextmanager
def running(worker: Worker) -> Iterator[None]:
    """Run ``worker`` in a thread for the block; stop it and wait for it after."""
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _ledger_count(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(Ledger)) or 0)


def _listeners(sessions: sessionmaker[Session]) -> list[int]:
    with sessions() as session:
        return list(session.scalars(text(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'sa_jobqueue listener' "
            "AND datname = current_database()"
        )))


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_notification_wakes_an_idle_worker_long_before_its_next_poll(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    # Polling every 120 s: a job that runs within the 30 s wait was woken by NOTIFY.
    with running(Worker(engine, jobs, tasks, mode=mode, poll_interval=120)):
        _wait_for(lambda: len(_listeners(sessions)) == 1, 30, "the listener to connect")
        time.sleep(0.3)  # let the worker's first empty poll pass and go idle
        with sessions.begin() as session:
            jobs.enqueue(session, "ledger")
        _wait_for(lambda: _ledger_count(sessions) == 1, 30, "the job to run")
    assert _listeners(sessions) == []


def test_the_listener_reconnects_after_its_connection_is_killed(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    with running(Worker(engine, jobs, tasks, poll_interval=120)):
        _wait_for(lambda: len(_listeners(sessions)) == 1, 30, "the listener to connect")
        [first] = _listeners(sessions)
        with sessions.begin() as session:
            session.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        _wait_for(lambda: _listeners(sessions) not in ([], [first]), 30, "the listener to reconnect")
        time.sleep(0.3)
        with sessions.begin() as session:
            jobs.enqueue(session, "ledger")
        _wait_for(lambda: _ledger_count(sessions) == 1, 30, "the job to run")


def test_listen_false_opens_no_listener_and_polling_still_runs_jobs(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    with running(Worker(engine, jobs, tasks, poll_interval=0.2, listen=False)):
        with sessions.begin() as session:
            jobs.enqueue(session, "ledger")
        _wait_for(lambda: _ledger_count(sessions) == 1, 30, "the job to run")
        assert _listeners(sessions) == []


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_busy_slot_does_not_delay_a_scheduled_job(engine: Engine, sessions: sessionmaker[Session], mode: str) -> None:
    """A job that comes due without a NOTIFY is claimed by the next poll even
    while another slot is busy with a long job (both modes)."""
    started, release = threading.Event(), threading.Event()
    registry = TaskRegistry()

    @registry.task("long")
    def long(job: TaskJob) -> None:
        started.set()
        release.wait(30)

    @registry.task("ledger")
    def ledger(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id))

    with running(Worker(engine, jobs, registry, mode=mode, concurrency=2, poll_interval=0.2, listen=False)):
        with sessions.begin() as session:
            jobs.enqueue(session, "long")
        assert started.wait(30), "the long job did not start"
        with sessions.begin() as session:
            jobs.enqueue(session, "ledger", delay=timedelta(milliseconds=300))
        try:
            _wait_for(lambda: _ledger_count(sessions) == 1, 15, "the scheduled job to run beside the long one")
        finally:
            release.set()
