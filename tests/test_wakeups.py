"""LISTEN/NOTIFY: one NOTIFY per transaction and queue, listeners that wake idle workers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from jobapp import Ledger, TaskJob, jobs, tasks
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker
from sqllog import recorded_sql
from waiting import wait_for

from sa_jobqueue import JobRepository, JobSpec, TaskRegistry, Worker
from sa_jobqueue.connections import raw_connect
from sa_jobqueue.listener import Listener


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


def _ledger_count(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(Ledger)) or 0)


def _listeners(sessions: sessionmaker[Session]) -> list[int]:
    """The backends of this database's worker listeners, by the name a
    listener gives its session once it LISTENs."""
    with sessions() as session:
        return list(session.scalars(text(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'sa_jobqueue listener' "
            "AND datname = current_database()"
        )))


# Every claim statement (sa_jobqueue/statements.py: claim) starts with its CTE.
_CLAIM = "WITH picked AS%"


@pytest.fixture
def claim_clock(engine: Engine) -> Iterator[Callable[[], float]]:
    """Server time (epoch seconds) at which the latest claim statement on
    task_jobs started; 0 before the first. A statement trigger records it
    in a sequence, which no rollback undoes (transaction mode rolls empty
    claims back)."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE SEQUENCE sajq_test_claim_clock MINVALUE 0 START 0")
        conn.execute(text(f"""
            CREATE FUNCTION sajq_test_claim_clock() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF current_query() LIKE '{_CLAIM}' THEN
                    PERFORM setval('sajq_test_claim_clock', greatest(
                        (SELECT last_value FROM sajq_test_claim_clock),
                        (extract(epoch FROM statement_timestamp()) * 1000000)::bigint));
                END IF;
                RETURN NULL;
            END $$"""))
        conn.exec_driver_sql(
            "CREATE TRIGGER sajq_test_claim_clock AFTER UPDATE ON task_jobs "
            "FOR EACH STATEMENT EXECUTE FUNCTION sajq_test_claim_clock()"
        )

    def latest() -> float:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT last_value FROM sajq_test_claim_clock").scalar_one()) / 1e6

    try:
        yield latest
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER sajq_test_claim_clock ON task_jobs")
            conn.exec_driver_sql("DROP FUNCTION sajq_test_claim_clock()")
            conn.exec_driver_sql("DROP SEQUENCE sajq_test_claim_clock")


@dataclass
class Stamp:
    """The ``stamp`` task's side: its handler blocks until :attr:`release` is
    set, then appends the server time (epoch seconds) at which it went on
    to :attr:`ran_at` and writes a ledger row."""

    release: threading.Event = field(default_factory=threading.Event)
    ran_at: list[float] = field(default_factory=list)


def _stamping_tasks() -> tuple[TaskRegistry, Stamp]:
    """``ledger``, and ``stamp`` (see :class:`Stamp`)."""
    registry, stamp = TaskRegistry(), Stamp()

    @registry.task("ledger")
    def ledger(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id))

    @registry.task("stamp")
    def stamped(job: TaskJob, session: Session) -> None:
        stamp.release.wait(60)
        stamp.ran_at.append(float(session.scalar(text("SELECT extract(epoch FROM statement_timestamp())")) or 0))
        session.add(Ledger(job_id=job.id))

    return registry, stamp


def _enqueue_stamp(sessions: sessionmaker[Session]) -> None:
    """Before the worker starts: its first claim takes the job, no NOTIFY needed."""
    with sessions.begin() as session:
        jobs.enqueue(session, "stamp")


def _until_idle(sessions: sessionmaker[Session], claim_clock: Callable[[], float], stamp: Stamp) -> None:
    """Let the stamp job end, then wait until the worker went idle after it.

    Call it once the worker's listener LISTENs. A worker claims again when a
    job ended: that claim starts after the job's handler went on. Once it
    has, and no claim runs, the worker waits for its next poll (poll_interval)
    unless a notification wakes it. Everything before, the listener's
    connection included, happened while the job held its slot, so that no
    job had to be enqueued while a claim might run: such a job can be missed
    by that claim, and the claim's empty result can make the worker forget
    the job's notification.
    """
    stamp.release.set()
    wait_for(lambda: len(stamp.ran_at) == 1, 30, "the stamp job to go on")

    def idle() -> bool:
        if claim_clock() <= stamp.ran_at[0]:
            return False
        with sessions() as session:
            return not session.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND state = 'active' AND query LIKE :claim"
            ), {"claim": _CLAIM})

    wait_for(idle, 30, "the worker's claim after the stamp job, and no claim running")


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_notification_wakes_an_idle_worker_long_before_its_next_poll(
    engine: Engine, sessions: sessionmaker[Session], claim_clock: Callable[[], float], mode: str
) -> None:
    # Once idle, the worker polls again after 96 s at the earliest (poll
    # interval 120 s, jitter -20%): a job that runs within the 30 s wait was
    # claimed because the NOTIFY woke the worker.
    registry, stamp = _stamping_tasks()
    _enqueue_stamp(sessions)
    with running(Worker(engine, jobs, registry, mode=mode, poll_interval=120)):
        wait_for(lambda: len(_listeners(sessions)) == 1, 30, "the listener to connect")
        _until_idle(sessions, claim_clock, stamp)
        with sessions.begin() as session:
            jobs.enqueue(session, "ledger")
        wait_for(lambda: _ledger_count(sessions) == 2, 30, "the job to run")
    # The listener closed its connection; its backend exits when it gets to it.
    wait_for(lambda: _listeners(sessions) == [], 30, "the listener's backend to exit")


def test_the_listener_reconnects_after_its_connection_is_killed(
    engine: Engine, sessions: sessionmaker[Session], claim_clock: Callable[[], float]
) -> None:
    registry, stamp = _stamping_tasks()
    _enqueue_stamp(sessions)
    with running(Worker(engine, jobs, registry, poll_interval=120)):
        wait_for(lambda: len(_listeners(sessions)) == 1, 30, "the listener to connect")
        [first] = _listeners(sessions)
        with sessions.begin() as session:
            session.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})

        def reconnected_alone() -> bool:
            now = _listeners(sessions)  # one snapshot: the old backend may still be exiting
            return len(now) == 1 and now[0] != first

        wait_for(reconnected_alone, 30, "the listener to reconnect")
        _until_idle(sessions, claim_clock, stamp)
        with sessions.begin() as session:
            jobs.enqueue(session, "ledger")
        wait_for(lambda: _ledger_count(sessions) == 2, 30, "the job to run")


def test_a_listener_connects_as_the_engine_does(db_url: URL, engine: Engine) -> None:
    """A Listener on its own: its connection carries the engine's connect
    arguments, it calls back on connect and on each notification, and its
    session is gone after stop()."""
    app = create_engine(db_url, connect_args={"application_name": "sajq_listener_probe"})
    notes: list[tuple[str, str]] = []
    connects = threading.Event()
    listener = Listener(raw_connect(app), [jobs.channel], on_notify=lambda c, p: notes.append((c, p)),
                        on_connect=connects.set, application_name=None, check_interval=0.1)

    def backends() -> list[int]:
        with engine.connect() as conn:
            return list(conn.execute(text(
                "SELECT pid FROM pg_stat_activity "
                "WHERE application_name = 'sajq_listener_probe' AND datname = current_database()"
            )).scalars())

    listener.start()
    try:
        assert connects.wait(30), "the listener never connected"
        assert listener.connected.is_set()
        assert len(backends()) == 1  # named by the engine's connect_args, not by the listener
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_notify(:channel, 'a queue')"), {"channel": jobs.channel})
        wait_for(lambda: notes == [(jobs.channel, "a queue")], 30, "the notification")
    finally:
        listener.stop()
        app.dispose()
    assert not listener.connected.is_set()
    wait_for(lambda: backends() == [], 30, "the listener's backend to exit")


def test_listen_false_opens_no_listener_and_polling_still_runs_jobs(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    with running(Worker(engine, jobs, tasks, poll_interval=0.2, listen=False)):
        with sessions.begin() as session:
            jobs.enqueue(session, "ledger")
        wait_for(lambda: _ledger_count(sessions) == 1, 30, "the job to run")
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
            wait_for(lambda: _ledger_count(sessions) == 1, 15, "the scheduled job to run beside the long one")
        finally:
            release.set()
