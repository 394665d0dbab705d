"""JobRepository.hand_back: claimed jobs that never started go back to the queue, uncounted."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from jobapp import TaskJob, jobs
from psycopg import sql
from sqlalchemy import Engine, event, select
from sqlalchemy.orm import Session, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import InvalidArgumentError, JobRepository, JobSpec

LEASE = timedelta(seconds=60)
TIMEOUT = 30.0


class Listener:
    """A raw LISTEN on one channel, on a connection of its own."""

    def __init__(self, url: str, channel: str) -> None:
        self.url, self.channel = url, channel
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def received(self) -> list[str]:
        """The payloads that arrived so far: everything before a sentinel that
        another connection notifies now (notifications arrive in commit order)."""
        sentinel = f"sentinel-{uuid.uuid4()}"
        with psycopg.connect(self.url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (self.channel, sentinel))
        payloads: list[str] = []
        deadline = time.monotonic() + TIMEOUT
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the sentinel did not arrive within {TIMEOUT} s; got {payloads}"
            for note in self.conn.notifies(timeout=left, stop_after=1):
                if note.payload == sentinel:
                    return payloads
                payloads.append(note.payload)


@pytest.fixture
def listener(libpq_url: str) -> Iterator[Listener]:
    listening = Listener(libpq_url, jobs.channel)
    yield listening
    listening.conn.close()


@pytest.fixture
def autocommit(engine: Engine) -> sessionmaker[Session]:
    """Sessions like the worker's own statements' in lease mode."""
    return sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False)


@contextmanager
def recorded_parameters(engine: Engine) -> Iterator[list[tuple[str, Any]]]:
    """The SQL text and parameters of every statement ``engine`` sends inside the block."""
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", record)


def _row(session: Session, job_id: int) -> TaskJob:
    row = session.get(TaskJob, job_id)
    assert row is not None
    return row


def test_hand_back_makes_claimed_jobs_pending_again_without_counting_the_attempt(
    sessions: sessionmaker[Session], autocommit: sessionmaker[Session]
) -> None:
    past = datetime.now(timezone.utc) - timedelta(minutes=5)
    with sessions.begin() as session:
        failed = jobs.enqueue(session, "noop", {"n": 0}, priority=-1)
        jobs.enqueue(session, "noop", {"n": 1}, run_at=past)
        jobs.enqueue(session, "noop", {"n": 2})
    # One job with a history: an attempt that failed (kept in last_error).
    with sessions.begin() as session:
        [first] = jobs.claim(session, lease=LEASE)
        assert first.id == failed.id
        jobs.fail(session, first, "boom", delay=timedelta(0))
    with autocommit.begin() as session:
        claimed = jobs.claim(session, limit=3, worker="shutting-down", lease=LEASE)
    assert [j.payload["n"] for j in claimed] == [0, 1, 2]
    assert [j.attempts for j in claimed] == [2, 1, 1]

    with autocommit.begin() as session:
        assert jobs.hand_back(session, claimed) == {j.id for j in claimed}

    with sessions() as session:
        for job in claimed:
            row = _row(session, job.id)
            assert row.status == "pending"
            assert row.attempts == job.attempts - 1
            assert (row.locked_by, row.locked_at, row.lock_token, row.lease_expires_at) == (None,) * 4
            assert row.run_at == job.run_at  # its place in the queue, not behind later jobs
            assert row.last_error == job.last_error and row.finished_at is None
        assert _row(session, failed.id).last_error == "boom"
    # Claimable again at once, in the same order; the next claim counts the attempt again.
    with sessions.begin() as session:
        again = jobs.claim(session, limit=3, lease=LEASE)
    assert [j.id for j in again] == [j.id for j in claimed]
    assert [j.attempts for j in again] == [2, 1, 1]


def test_hand_back_is_fenced_and_returns_only_the_jobs_it_gave_back(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop", {"n": n}) for n in range(3)])
    with sessions.begin() as session:
        [stale] = jobs.claim(session, lease=timedelta(milliseconds=1))
        kept, finished = jobs.claim(session, limit=2, lease=LEASE)
    # The first claim's lease expires: reaped and claimed again by another worker.
    deadline = time.monotonic() + TIMEOUT
    while True:
        with sessions.begin() as session:
            if jobs.reap(session).requeued:
                break
        assert time.monotonic() < deadline, "the lease did not expire"
        time.sleep(0.01)
    with sessions.begin() as session:
        [fresh] = jobs.claim(session, worker="fresh", lease=LEASE)
        jobs.complete(session, finished)
    assert fresh.id == stale.id and fresh.lock_token != stale.lock_token

    with sessions.begin() as session:
        assert jobs.hand_back(session, [stale, kept, finished]) == {kept.id}
        assert jobs.hand_back(session, [kept]) == set()  # not owned any more

    with sessions() as session:
        row = _row(session, fresh.id)
        assert (row.status, row.locked_by, row.lock_token, row.attempts) == ("running", "fresh", fresh.lock_token, 2)
        assert _row(session, kept.id).status == "pending"
        assert session.get(TaskJob, finished.id) is None


def test_hand_back_is_one_statement_and_notifies_each_queue_once(
    sessions: sessionmaker[Session], engine: Engine, listener: Listener
) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop", queue=q) for q in ("a", "a", "b", "c")])
    with sessions.begin() as session:
        claimed = jobs.claim(session, queues=["a", "b", "c"], limit=4, lease=LEASE)
    assert listener.received() == ["a", "b", "c"]  # the enqueue's

    with recorded_parameters(engine) as sent, sessions.begin() as session:
        jobs.enqueue(session, "noop", queue="c")  # notifies 'c' in this transaction
        assert len(jobs.hand_back(session, claimed)) == 4
        assert listener.received() == []  # NOTIFY is heard at commit
    # The enqueue's INSERT, one UPDATE for the four jobs, one NOTIFY statement
    # for the queues this transaction had not notified yet.
    assert [statement.split()[0] for statement, _ in sent] == ["INSERT", "UPDATE", "SELECT"]
    assert "pg_notify" in sent[2][0] and sent[2][1]["queues"] == ["a", "b"]
    assert sorted(listener.received()) == ["a", "b", "c"]

    with sessions.begin() as session:
        claimed = jobs.claim(session, queues=["a", "b", "c"], limit=5, lease=LEASE)
    quiet = JobRepository(TaskJob, notify=False)
    with recorded_sql(engine) as sent, sessions.begin() as session:
        assert len(quiet.hand_back(session, claimed)) == 5
    assert len(sent) == 1
    assert listener.received() == []


def test_hand_back_in_autocommit_notifies_at_once(autocommit: sessionmaker[Session], listener: Listener) -> None:
    with autocommit.begin() as session:
        jobs.enqueue(session, "noop", queue="q")
    with autocommit.begin() as session:
        claimed = jobs.claim(session, queues="q", lease=LEASE)
    assert listener.received() == ["q"]
    with autocommit.begin() as session:
        assert jobs.hand_back(session, claimed) == {claimed[0].id}
        # Autocommit: the UPDATE and its NOTIFY took effect as they ran.
        assert listener.received() == ["q"]
        assert session.scalar(select(TaskJob.status).where(TaskJob.id == claimed[0].id)) == "pending"


def test_hand_back_checks_its_arguments_before_sending_anything(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    with sessions.begin() as session:
        pending = jobs.enqueue(session, "noop")
    with recorded_sql(engine) as sent, sessions.begin() as session:
        for bad, parameter in [
            ((None, []), "session"),
            ((session, None), "jobs"),
            ((session, "jobs"), "jobs"),
            ((session, [pending]), "jobs"),  # not claimed: no lock_token
            ((session, [object()]), "jobs"),
        ]:
            with pytest.raises(InvalidArgumentError) as raised:
                jobs.hand_back(*bad)  # type: ignore[arg-type]
            assert raised.value.parameter == parameter
        assert jobs.hand_back(session, []) == set()
    assert sent == []
