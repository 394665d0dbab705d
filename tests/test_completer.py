"""Batched completions in the thread worker: many per statement, each one statement on a connection
of its own engine without a session around it; none lost when the server ends that connection
(sa_jobqueue/worker/completer.py)."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from typing import Any

import pytest
from jobapp import TaskJob, jobs, tasks
from sqlalchemy import Engine, event, func, select, update
from sqlalchemy.orm import Session, sessionmaker
from sqllog import on_own_engines
from waiting import terminate_backend, wait_for

from sa_jobqueue import JobSpec, TaskRegistry, Worker, signals
from sa_jobqueue.worker.books import Books
from sa_jobqueue.worker.completer import Completer

COMPLETER = os.path.join("worker", "completer.py")


def _by_completer() -> bool:
    return any(frame.filename.endswith(COMPLETER) for frame in traceback.extract_stack())


class OwnEngine:
    """What the worker's own engine does, recorded from the moment the worker makes it: the
    statements it sends, the backend pids of the connections the completer checks out of it,
    and how many sessions the completer began on it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, statements: bool = False) -> None:
        self.sent: list[str] = []
        self.completer_pids: list[int] = []
        self.completer_sessions = 0
        self.engine: Engine | None = None

        def record(own: Engine) -> None:
            self.engine = own
            event.listen(own, "checkout", self._checkout)
            if statements:  # a listener that reads statements sends them through SQLAlchemy
                event.listen(own, "before_cursor_execute", self._statement)

        on_own_engines(monkeypatch, record)
        event.listen(Session, "after_begin", self._session_began)

    def stop(self) -> None:
        """Stop recording the sessions (the engine's own listeners go with it)."""
        event.remove(Session, "after_begin", self._session_began)

    def _checkout(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if _by_completer():
            self.completer_pids.append(dbapi_connection.info.backend_pid)

    def _statement(self, conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        self.sent.append(statement)

    def _session_began(self, session: Session, transaction: Any, connection: Any) -> None:
        if connection.engine is self.engine and _by_completer():
            self.completer_sessions += 1


def test_sessionless_completions_go_in_batches_without_a_session(
    engine: Engine, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 jobs at most 100 per write: ten writes or more, many jobs each, each a statement
    on a connection of the worker's own engine with no session begun around it."""
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop") for _ in range(1000)])
    own = OwnEngine(monkeypatch, statements=True)
    try:
        result = Worker(engine, jobs, tasks, poll_interval=0.1, concurrency=4).run(until_empty=True)
    finally:
        own.stop()
    deletes = [s for s in own.sent if s.startswith("DELETE FROM task_jobs")]
    assert (result.completed, result.lost) == (1000, 0)
    assert 10 <= len(deletes) < 1000 / 2 and all("ANY" in d for d in deletes)  # many completions per statement
    assert len(own.completer_pids) == len(deletes)  # the writes' connections, each of the worker's own pool
    assert own.completer_sessions == 0
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


def test_a_connection_the_server_ended_under_the_completer_loses_no_completion(
    engine: Engine, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ends the connection of the completer's latest write while jobs still run: a
    write that meets it fails and is written again on another connection; every job completes once."""
    registry = TaskRegistry()
    registry.register("noop", lambda job: time.sleep(0.002))
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop") for _ in range(3000)])
    own = OwnEngine(monkeypatch)
    pids = own.completer_pids
    worker = Worker(engine, jobs, registry, poll_interval=0.1, concurrency=4)
    thread = threading.Thread(target=worker.run, kwargs={"until_empty": True})
    thread.start()
    try:
        wait_for(lambda: worker.result.completed >= 300 and bool(pids), 60, "the first completions")
        terminate_backend(engine, pids[-1], "the end of the completer's connection")
        thread.join(timeout=120)
        assert not thread.is_alive()
    finally:
        worker.stop()
        thread.join(timeout=30)
        own.stop()
    result = worker.result
    assert (result.completed, result.retried, result.dead, result.lost) == (3000, 0, 0, 0)
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


def test_one_write_settles_each_of_its_jobs_in_the_books_as_completed_or_lost(
    engine: Engine, sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """A write of six completions in two queues, two of whose jobs another owner holds now: four
    completed (counted, tallied per queue, signalled once each, their rows gone), two lost (counted,
    logged by id, their rows untouched), and none of the six held any more."""
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop", queue=queue) for queue in "aaabbb"])
    with sessions.begin() as session:
        claimed = jobs.claim(session, queues=["a", "b"], limit=6)
    assert len(claimed) == 6
    taken = [next(j for j in claimed if j.queue == queue) for queue in "ab"]
    with sessions.begin() as session:  # another owner's lock now (the lease expired and the job was claimed again)
        session.execute(update(TaskJob).where(TaskJob.id.in_([j.id for j in taken])).values(lock_token=uuid.uuid4()))
    books = Books()
    for job in claimed:
        books.hold(jobs, job)
    succeeded: list[int] = []

    def on_success(sender: object, job: Any, duration: float) -> None:
        succeeded.append(job.id)

    signals.job_succeeded.connect(on_success)
    completer = Completer(books, sessions.begin, engine=engine.execution_options(isolation_level="AUTOCOMMIT"),
                          write_when_full=False)
    try:
        for job in claimed:
            completer.add(jobs, job, 0.01)
        with caplog.at_level(logging.WARNING, logger="sa_jobqueue.worker"):
            completer.flush()
    finally:
        signals.job_succeeded.disconnect(on_success)
    done = sorted(j.id for j in claimed if j not in taken)
    assert (books.result.completed, books.result.lost) == (4, 2)
    assert books.take_tally() == {("task_jobs", "a"): [2, 0], ("task_jobs", "b"): [2, 0]}
    assert sorted(succeeded) == done
    assert books.held() == [] and len(completer) == 0
    lost_lines = [r.getMessage() for r in caplog.records if "after its lease was lost" in r.getMessage()]
    assert sorted(lost_lines) == sorted(f"worker worker: job {j.id} finished after its lease was lost" for j in taken)
    with sessions() as session:
        left = session.scalars(select(TaskJob.id).order_by(TaskJob.id)).all()
    assert left == sorted(j.id for j in taken)
