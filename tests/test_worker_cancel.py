"""Cancelling a running job (docs/concepts.md, "Cancelling a job"): the worker
learns of the request at its next heartbeat or at once through NOTIFY, the
handler sees it on ``job.cancel_requested_at``, and the job ends cancelled
with none of its database writes committed."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from jobapp import Ledger, TaskJob, jobs
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker
from waiting import wait_for

from sa_jobqueue import TaskRegistry, Worker


def _status(sessions: sessionmaker[Session], job_id: int) -> str | None:
    with sessions() as session:
        row = session.get(TaskJob, job_id)
        return None if row is None else row.status


@pytest.mark.parametrize("learned_by", ["notify", "heartbeat"])
def test_a_cooperative_handler_sees_the_cancel_and_its_writes_never_commit(
    engine: Engine, sessions: sessionmaker[Session], learned_by: str
) -> None:
    registry = TaskRegistry()
    started = threading.Event()
    saw: list[bool] = []

    @registry.task
    def cooperative(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id, note="written before the cancel"))
        session.flush()
        started.set()
        deadline = time.monotonic() + 60
        while job.cancel_requested_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        saw.append(job.cancel_requested_at is not None)

    with sessions.begin() as session:
        job = jobs.enqueue(session, "cooperative")
    # Through NOTIFY: a heartbeat far away. Through the heartbeat: no listener.
    worker = Worker(engine, jobs, registry, concurrency=1, poll_interval=0.05,
                    listen=learned_by == "notify", lease=timedelta(seconds=60),
                    heartbeat_interval=timedelta(seconds=30 if learned_by == "notify" else 0.2))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert started.wait(60)
        with sessions.begin() as session:
            assert jobs.cancel(session, job.id) is True
        wait_for(lambda: _status(sessions, job.id) == "cancelled", 60, "the job to end cancelled")
    finally:
        worker.stop()
        thread.join(60)
    assert saw == [True]
    with sessions() as session:
        assert session.scalars(select(Ledger.job_id)).all() == []  # its writes rolled back
        row = session.get(TaskJob, job.id)
        assert row is not None and row.last_error == "cancelled while running" and row.lock_token is None
    assert worker.result.cancelled == 1 and worker.result.completed == 0


def test_a_handler_that_ignores_the_cancel_is_ended_at_its_deadline(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    registry = TaskRegistry()
    started = threading.Event()
    release = threading.Event()

    @registry.task(timeout=1.0)
    def stubborn(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id))
        session.flush()
        started.set()
        release.wait(60)

    with sessions.begin() as session:
        job = jobs.enqueue(session, "stubborn")
    worker = Worker(engine, jobs, registry, concurrency=1, poll_interval=0.05)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert started.wait(60)
        with sessions.begin() as session:
            assert jobs.cancel(session, job.id) is True
        wait_for(lambda: _status(sessions, job.id) == "cancelled", 60, "the job to end cancelled")
    finally:
        release.set()
        worker.stop()
        thread.join(60)
    with sessions() as session:
        assert session.scalars(select(Ledger.job_id)).all() == []
    assert worker.result.cancelled == 1
