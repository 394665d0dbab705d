"""``sa-jobqueue queues`` and ``workers``, and what ``health`` and ``jobs show``
say of workers and progress, against the real PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session
from waiting import wait_for

from sa_jobqueue import JobRepository, TaskRegistry, Worker, paused_queues, report_progress
from sa_jobqueue.cli import main
from sa_jobqueue.default import Job

repo = JobRepository(Job)


@pytest.fixture(autouse=True)
def _empty(default_table: tuple[str, Engine]) -> Iterator[None]:
    yield
    with default_table[1].begin() as conn:
        conn.execute(text("TRUNCATE sa_jobqueue_jobs, sa_jobqueue_paused_queues, sa_jobqueue_workers"))


def _run(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"DATABASE_URL": url}, prog_name="sa-jobqueue")


def _ok(url: str, *args: str) -> str:
    result = _run(url, *args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_queues_pause_list_resume(default_table: tuple[str, Engine]) -> None:
    url, engine = default_table
    assert _ok(url, "queues", "list").strip() == "no queue is paused"
    assert _ok(url, "queues", "pause", "mail", "--by", "provider down").strip() == "paused mail of sa_jobqueue_jobs"
    assert "was already paused" in _ok(url, "queues", "pause", "mail")
    listed = _ok(url, "queues", "list")
    assert "sa_jobqueue_jobs" in listed and "mail" in listed and "provider down" in listed
    with Session(engine) as session:
        assert paused_queues(session) == {"sa_jobqueue_jobs": {"mail"}}
    assert _ok(url, "queues", "resume", "mail").strip() == "resumed mail of sa_jobqueue_jobs"
    assert "was not paused" in _ok(url, "queues", "resume", "mail")
    bad = _run(url, "queues", "pause", "")
    assert bad.exit_code == 1 and "queue" in bad.output and "Traceback" not in bad.output


def test_workers_health_and_jobs_show_follow_a_running_worker(default_table: tuple[str, Engine]) -> None:
    url, engine = default_table
    assert _ok(url, "workers").strip() == "no worker has announced itself"
    assert "workers           0 alive serving sa_jobqueue_jobs" in _ok(url, "health")
    failed = _run(url, "health", "--min-workers", "1")
    assert failed.exit_code == 1 and "fewer than --min-workers 1" in failed.output
    registry, release = TaskRegistry(), threading.Event()

    @registry.task
    def exporting(job: Job) -> None:
        report_progress(job, 0.4, "rows 400 of 1000")
        release.wait(60)

    with Session(engine) as session, session.begin():
        job_id = repo.enqueue(session, "exporting").id
    worker = Worker(engine, repo, registry, poll_interval=0.05, name="cli-seen", lease=timedelta(seconds=3),
                    heartbeat_interval=timedelta(seconds=0.2))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: "40% rows 400 of 1000" in _ok(url, "jobs", "show", str(job_id)), 30,
                 "jobs show to show the heartbeat's progress")
        wait_for(lambda: "40% rows 400 of 1000" in _ok(url, "workers", "--running"), 30,
                 "workers --running to show the job")
        listed = _ok(url, "workers", "--running")
        assert "cli-seen" in listed and "alive" in listed and f"sa_jobqueue_jobs job {job_id} (exporting" in listed
        assert "workers           1 alive serving sa_jobqueue_jobs" in _ok(url, "health", "--min-workers", "1")
    finally:
        release.set()
        worker.stop()
        thread.join(timeout=60)
    assert _ok(url, "workers").strip() == "no worker has announced itself"


def test_without_the_operations_tables_the_commands_say_so_in_one_line(create_database: object) -> None:
    made = create_database()  # type: ignore[operator]
    engine = create_engine(made)
    Job.metadata.create_all(engine)
    engine.dispose()
    url = made.set(drivername="postgresql").render_as_string(hide_password=False)
    for args in (["workers"], ["queues", "list"], ["queues", "pause", "q"]):
        result = _run(url, *args)
        assert result.exit_code == 1 and "does not exist" in result.output and "Traceback" not in result.output
    assert "no sa_jobqueue_workers table" in _ok(url, "health")
