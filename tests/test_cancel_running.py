"""Cancelling a running job: the request, its NOTIFY, extend_leases, mark_cancelled, and reap."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from jobapp import ReportJob, TaskJob, jobs, reports
from psycopg import sql
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import InvalidArgumentError, JobLostError, ReapResult
from sa_jobqueue.channels import channel_name
from sa_jobqueue.mixin import MAX_TABLE_NAME_BYTES
from sa_jobqueue.repository import LeaseReport, cancel_channel_name

LEASE = timedelta(seconds=60)
TIMEOUT = 30.0


@pytest.fixture
def autocommit(engine: Engine) -> sessionmaker[Session]:
    """Sessions like the worker's own statements' in lease mode."""
    return sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False)


@pytest.fixture
def cancels(libpq_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A raw connection that LISTENs on task_jobs' cancel channel."""
    conn = psycopg.connect(libpq_url, autocommit=True)
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(jobs.cancel_channel)))
    yield conn
    conn.close()


def _received(conn: psycopg.Connection[tuple[object, ...]], url: str, channel: str) -> list[str]:
    """The payloads that arrived on ``channel`` so far: everything before a
    sentinel notified now from another connection (commit order)."""
    sentinel = f"sentinel-{uuid.uuid4()}"
    with psycopg.connect(url, autocommit=True) as other:
        other.execute("SELECT pg_notify(%s, %s)", (channel, sentinel))
    payloads: list[str] = []
    deadline = time.monotonic() + TIMEOUT
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the sentinel did not arrive within {TIMEOUT} s; got {payloads}"
        for note in conn.notifies(timeout=left, stop_after=1):
            if note.payload == sentinel:
                return payloads
            payloads.append(note.payload)


def _row(session: Session, job_id: int) -> TaskJob:
    row = session.get(TaskJob, job_id)
    assert row is not None
    return row


def _expire_and_reap(sessions: sessionmaker[Session], expected: int) -> ReapResult:
    """Reap until ``expected`` jobs (whose leases are about to expire) were reaped; the sum."""
    total = ReapResult(requeued=0, dead=0, cancelled=0)
    deadline = time.monotonic() + TIMEOUT
    while total.requeued + total.dead + total.cancelled < expected:
        assert time.monotonic() < deadline, f"reaped {total} within {TIMEOUT} s"
        with sessions.begin() as session:
            got = jobs.reap(session)
        total = ReapResult(total.requeued + got.requeued, total.dead + got.dead, total.cancelled + got.cancelled)
        time.sleep(0.01)
    return total


def test_the_cancel_channel_is_the_tables_own_and_apart_from_its_wakeups() -> None:
    assert jobs.cancel_channel == cancel_channel_name("task_jobs")
    assert reports.cancel_channel == cancel_channel_name("report_jobs") != jobs.cancel_channel
    assert jobs.cancel_channel != jobs.channel
    # Not the wake-up channel of a table named like it: no plain identifier holds a ':'.
    assert ":" in jobs.cancel_channel and jobs.cancel_channel != channel_name("cancel_task_jobs")
    # Fits PostgreSQL's 63-byte channel names for the longest table name a job table may have.
    assert len(cancel_channel_name("t" * MAX_TABLE_NAME_BYTES).encode()) <= 63


def test_cancel_of_a_running_job_records_the_request_and_notifies_it(
    autocommit: sessionmaker[Session],
    sessions: sessionmaker[Session],
    cancels: psycopg.Connection[tuple[object, ...]],
    libpq_url: str,
) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "noop")
        pending = jobs.enqueue(session, "noop", priority=1)
    with autocommit.begin() as session:
        [claimed] = jobs.claim(session, worker="w", lease=LEASE)
    assert claimed.id == job.id

    with sessions.begin() as session:
        assert jobs.cancel(session, job.id) is True
        assert _received(cancels, libpq_url, jobs.cancel_channel) == []  # heard at commit
    assert _received(cancels, libpq_url, jobs.cancel_channel) == [str(job.id)]
    with sessions() as session:
        row = _row(session, job.id)
        assert (row.status, row.lock_token, row.locked_by) == ("running", claimed.lock_token, "w")
        assert row.finished_at is None
        requested = row.cancel_requested_at
        assert requested is not None

    # Asking again: still True, the first request's time is kept, notified again.
    with sessions.begin() as session:
        assert jobs.cancel(session, job.id) is True
    with sessions() as session:
        assert _row(session, job.id).cancel_requested_at == requested
    assert _received(cancels, libpq_url, jobs.cancel_channel) == [str(job.id)]

    # A pending job is cancelled at once, with no request and nothing on the cancel channel.
    with autocommit.begin() as session:
        assert jobs.cancel(session, pending.id) is True
        row = _row(session, pending.id)
        assert (row.status, row.cancel_requested_at) == ("cancelled", None) and row.finished_at is not None
    assert _received(cancels, libpq_url, jobs.cancel_channel) == []


def test_extend_leases_reports_the_request_and_mark_cancelled_ends_the_job(
    autocommit: sessionmaker[Session], sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", {"n": 1}, priority=-1)
        second = jobs.enqueue(session, "noop", {"n": 2})
    with autocommit.begin() as session:
        claimed = jobs.claim(session, limit=2, lease=timedelta(seconds=30))
        assert [j.id for j in claimed] == [first.id, second.id]
        assert jobs.extend_leases(session, claimed, lease=LEASE) == LeaseReport(
            owned={first.id, second.id}, cancel_requested=set()
        )
        assert jobs.cancel(session, first.id) is True
        before = _row(session, first.id).lease_expires_at
        report = jobs.extend_leases(session, claimed, lease=timedelta(minutes=10))
        assert report == LeaseReport(owned={first.id, second.id}, cancel_requested={first.id})
        after = _row(session, first.id).lease_expires_at
        assert before is not None and after is not None and after > before
        # heartbeat: the same statement, the same answer as before.
        assert jobs.heartbeat(session, claimed, lease=LEASE) == {first.id, second.id}

    with sessions.begin() as session:
        jobs.mark_cancelled(session, claimed[0])
    with sessions() as session:
        row = _row(session, first.id)
        assert row.status == "cancelled" and row.finished_at is not None
        assert (row.locked_by, row.locked_at, row.lock_token, row.lease_expires_at) == (None,) * 4
        assert row.last_error == "cancelled while running"
        assert row.attempts == 1 and row.cancel_requested_at is not None  # the record of the request
        assert _row(session, second.id).status == "running"
    with sessions.begin() as session:
        # No longer owned: nothing after the cancel takes effect.
        assert jobs.extend_leases(session, claimed, lease=LEASE) == LeaseReport(
            owned={second.id}, cancel_requested=set()
        )
        with pytest.raises(JobLostError):
            jobs.mark_cancelled(session, claimed[0])
        with pytest.raises(JobLostError):
            jobs.complete(session, claimed[0])
        jobs.mark_cancelled(session, claimed[1], "stopped by the operator\x00" + "x" * 20_000)
    with sessions() as session:
        error = _row(session, second.id).last_error
        assert error is not None and error.startswith("stopped by the operator\ufffd") and len(error) <= 10_000

    # retry starts a new run without the old request.
    with sessions.begin() as session:
        assert jobs.retry(session, first.id) is True
        assert _row(session, first.id).cancel_requested_at is None
    with autocommit.begin() as session:
        [again] = jobs.claim(session, lease=LEASE)
        assert again.id == first.id and again.cancel_requested_at is None
        assert jobs.extend_leases(session, [again], lease=LEASE).cancel_requested == set()


def test_a_stale_claim_can_neither_mark_cancelled_nor_see_the_request(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "noop")
    with sessions.begin() as session:
        [stale] = jobs.claim(session, worker="stale", lease=timedelta(milliseconds=1))
    assert _expire_and_reap(sessions, 1) == ReapResult(requeued=1, dead=0, cancelled=0)
    with sessions.begin() as session:
        [fresh] = jobs.claim(session, worker="fresh", lease=LEASE)
        assert jobs.cancel(session, job.id) is True
    with sessions.begin() as session:
        with pytest.raises(JobLostError, match="cannot mark cancelled"):
            jobs.mark_cancelled(session, stale)
        assert jobs.extend_leases(session, [stale], lease=LEASE) == LeaseReport(owned=set(), cancel_requested=set())
        assert jobs.extend_leases(session, [stale, fresh], lease=LEASE) == LeaseReport(
            owned={fresh.id}, cancel_requested={fresh.id}
        )
    with sessions() as session:
        row = _row(session, job.id)
        assert (row.status, row.locked_by, row.lock_token, row.last_error) == (
            "running", "fresh", fresh.lock_token, row.last_error
        )
        assert "cancelled" not in (row.last_error or "")


def test_reap_cancels_an_expired_job_with_a_request_instead_of_requeueing_it(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        requested = jobs.enqueue(session, "noop", {"n": 1}, priority=-2)
        plain = jobs.enqueue(session, "noop", {"n": 2}, priority=-1)
        exhausted = jobs.enqueue(session, "noop", {"n": 3}, max_attempts=1)
    with sessions.begin() as session:
        claimed = jobs.claim(session, limit=3, worker="crashed", lease=timedelta(milliseconds=1))
        assert [j.id for j in claimed] == [requested.id, plain.id, exhausted.id]
        assert jobs.cancel(session, requested.id) is True
        assert jobs.cancel(session, exhausted.id) is True

    assert _expire_and_reap(sessions, 3) == ReapResult(requeued=1, dead=0, cancelled=2)
    with sessions() as session:
        for job_id in (requested.id, exhausted.id):
            row = _row(session, job_id)
            assert row.status == "cancelled" and row.finished_at is not None
            assert row.last_error == "cancelled while running: lease expired at attempt 1 (worker crashed)"
            assert (row.locked_by, row.lock_token, row.lease_expires_at) == (None, None, None)
        row = _row(session, plain.id)
        assert (row.status, row.finished_at) == ("pending", None)
        assert row.last_error == "lease expired at attempt 1 (worker crashed)"


def test_a_failure_or_a_hand_back_after_the_request_ends_the_job_cancelled(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    with sessions.begin() as session:
        failing = jobs.enqueue(session, "noop", {"n": 1}, priority=-1)
        handed = jobs.enqueue(session, "noop", {"n": 2})
    with sessions.begin() as session:
        first, second = jobs.claim(session, limit=2, lease=LEASE)
        assert jobs.cancel(session, failing.id) and jobs.cancel(session, handed.id)
    with sessions.begin() as session:
        # A retry would run it again against the request: cancelled instead.
        assert jobs.fail(session, first, "RuntimeError: interrupted", delay=timedelta(0)) == "cancelled"
    with recorded_sql(engine) as sent, sessions.begin() as session:
        assert jobs.hand_back(session, [second]) == {handed.id}
    assert not [s for s in sent if "pg_notify" in s]  # nothing was made pending
    with sessions() as session:
        row = _row(session, failing.id)
        assert (row.status, row.last_error, row.attempts) == ("cancelled", "RuntimeError: interrupted", 1)
        assert row.finished_at is not None
        row = _row(session, handed.id)
        assert (row.status, row.attempts, row.lock_token) == ("cancelled", 0, None) and row.finished_at is not None
    with sessions.begin() as session:
        assert jobs.claim(session, limit=2, lease=LEASE) == []


def test_cancel_of_a_finished_or_missing_job_is_false_and_changes_nothing(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    with sessions.begin() as session:
        dead = jobs.enqueue(session, "noop")
        cancelled = jobs.enqueue(session, "noop")
        done = reports.enqueue(session, "noop")
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
        assert claimed.id == dead.id
        jobs.fail(session, claimed, "boom", discard=True)
        assert jobs.cancel(session, cancelled.id) is True
        [report] = reports.claim(session, lease=LEASE)
        reports.complete(session, report)
    with sessions() as session:
        before = {j: (r.status, r.finished_at, r.last_error) for j in (dead.id, cancelled.id)
                  for r in [_row(session, j)]}
    with sessions.begin() as session:
        assert jobs.cancel(session, dead.id) is False
        assert jobs.cancel(session, cancelled.id) is False
        assert jobs.cancel(session, 10**12) is False
        assert reports.cancel(session, done.id) is False
    with sessions() as session:
        after = {j: (r.status, r.finished_at, r.last_error) for j in (dead.id, cancelled.id)
                 for r in [_row(session, j)]}
        assert after == before
        row = session.get(ReportJob, done.id)
        assert row is not None and (row.status, row.cancel_requested_at) == ("done", None)
        assert _row(session, dead.id).cancel_requested_at is None


def test_the_new_verbs_check_their_arguments_before_sending_anything(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    with sessions.begin() as session:
        pending = jobs.enqueue(session, "noop", {"n": 1})
        jobs.enqueue(session, "noop", {"n": 2})
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
    with recorded_sql(engine) as sent, sessions.begin() as session:
        cases = [
            (lambda: jobs.mark_cancelled(None, claimed), "session"),  # type: ignore[arg-type]
            (lambda: jobs.mark_cancelled(session, pending), "job"),  # not claimed
            (lambda: jobs.mark_cancelled(session, object()), "job"),  # type: ignore[arg-type]
            (lambda: reports.mark_cancelled(session, claimed), "job"),  # type: ignore[arg-type]
            (lambda: jobs.mark_cancelled(session, claimed, None), "reason"),  # type: ignore[arg-type]
            (lambda: jobs.mark_cancelled(session, claimed, b"bytes"), "reason"),  # type: ignore[arg-type]
            (lambda: jobs.extend_leases(session, claimed, lease=LEASE), "jobs"),  # type: ignore[arg-type]
            (lambda: jobs.extend_leases(session, [pending], lease=LEASE), "jobs"),
            (lambda: jobs.extend_leases(session, [claimed], lease=timedelta(0)), "lease"),
            (lambda: jobs.extend_leases(session, [claimed], lease=60), "lease"),  # type: ignore[arg-type]
            (lambda: jobs.extend_leases(None, [claimed], lease=LEASE), "session"),  # type: ignore[arg-type]
            (lambda: jobs.cancel(session, "1"), "job_id"),  # type: ignore[arg-type]
            (lambda: jobs.cancel(session, 2**63), "job_id"),
        ]
        for call, parameter in cases:
            with pytest.raises(InvalidArgumentError) as raised:
                call()
            assert raised.value.parameter == parameter
        assert jobs.extend_leases(session, [], lease=LEASE) == LeaseReport(owned=set(), cancel_requested=set())
    assert sent == []
