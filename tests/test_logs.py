"""Every log record written while a worker runs a job carries that job's id,
task, queue and attempt (sa_jobqueue/logs.py), in both modes."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from jobapp import TaskJob, jobs
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from sa_jobqueue import JobSpec, RetryPolicy, TaskRegistry, Worker
from sa_jobqueue.logs import JobLogFilter, current_job

app_log = logging.getLogger("tests.app")


class Capture(logging.Handler):
    """Keeps the records that reached it, after its filters ran."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.addFilter(JobLogFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> list[logging.LogRecord]:
    handler = Capture()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_records_carry_the_job_they_were_written_for(
    engine: Engine, sessions: sessionmaker[Session], captured: list[logging.LogRecord], mode: str
) -> None:
    registry = TaskRegistry()

    @registry.task("greet")
    def greet(job: TaskJob) -> None:
        app_log.info("hello %s", job.payload["n"])

    @registry.task("boom", retry=RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0))
    def boom(job: TaskJob, session: Session) -> None:
        app_log.info("about to fail")
        raise ValueError("nope")

    with sessions.begin() as session:
        greeted = jobs.enqueue_many(session, [JobSpec("greet", {"n": n}, queue="q1") for n in range(5)])
        failing = jobs.enqueue(session, "boom", queue="q2", max_attempts=2)
    app_log.info("outside any job")
    Worker(engine, jobs, registry, queues=["q1", "q2"], mode=mode, concurrency=3, poll_interval=0.05,
           listen=False).run(until_empty=True)

    hellos = {r.getMessage(): r for r in captured if r.getMessage().startswith("hello")}
    assert {(r.job_id, r.job_task, r.job_queue, r.job_attempt) for r in hellos.values()} == {  # type: ignore[attr-defined]
        (job.id, "greet", "q1", 1) for job in greeted
    }
    assert all(hellos[f"hello {job.payload['n']}"].job_id == job.id for job in greeted)  # type: ignore[attr-defined]
    fails = [r for r in captured if r.getMessage() == "about to fail"]
    assert sorted(r.job_attempt for r in fails) == [1, 2]  # type: ignore[attr-defined]
    assert {(r.job_id, r.job_queue) for r in fails} == {(failing.id, "q2")}  # type: ignore[attr-defined]
    # The worker's own record of the failure carries the job too.
    worker_records = [r for r in captured if r.name == "sa_jobqueue.worker" and "failed" in r.getMessage()]
    assert worker_records and all(r.job_id == failing.id for r in worker_records)  # type: ignore[attr-defined]
    outside = [r for r in captured if r.getMessage() == "outside any job"]
    assert [r.job_id for r in outside] == [None]  # type: ignore[attr-defined]
    assert current_job.get() is None
