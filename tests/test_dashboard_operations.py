"""The dashboard's Workers page, pausing and resuming a queue, and a running job's
progress (docs/dashboard.md), over HTTP against ``sa-jobqueue dashboard`` and a real PostgreSQL."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import jobapp
import pytest
from dashboard_server import browser_like, get, post, serving
from jobapp import TaskJob, jobs
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session
from waiting import wait_for

from sa_jobqueue import TaskRegistry, Worker, paused_queues, report_progress


@pytest.fixture(scope="module")
def database(module_database: tuple[URL, Engine]) -> tuple[URL, Engine]:
    return module_database


@pytest.fixture(scope="module")
def address(database: tuple[URL, Engine]) -> Iterator[str]:
    with serving(database[0]) as served:
        yield served


@pytest.fixture
def own(database: tuple[URL, Engine]) -> Iterator[Engine]:
    yield database[1]
    with database[1].begin() as conn:
        conn.execute(text("TRUNCATE task_jobs, sa_jobqueue_paused_queues, sa_jobqueue_workers"))


def _confirmed(address: str, query: str) -> tuple[Any, dict[str, str]]:
    client = browser_like()
    status, html = get(address, f"/queues/confirm?{query}", client)
    assert status == 200, html
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', html))
    assert fields.get("csrf")
    return client, fields


def _paused(engine: Engine) -> dict[str, set[str]]:
    with Session(engine) as session:
        return paused_queues(session)


def test_pause_and_resume_a_queue_from_the_overview(address: str, own: Engine) -> None:
    with Session(own) as session, session.begin():
        jobs.enqueue(session, "noop", queue="mail")
    status, html = get(address, "/")
    assert status == 200 and 'data-queue-operation="pause"' in html and 'data-paused="mail"' not in html
    client, fields = _confirmed(address, "table=task_jobs&queue=mail&operation=pause")
    assert fields["operation"] == "pause" and fields["queue"] == "mail"
    status, html = post(address, "/queues/act", fields, client)
    assert status == 200 and "Paused" in html
    assert _paused(own) == {"task_jobs": {"mail"}}
    status, html = get(address, "/")
    assert 'data-paused="mail"' in html and 'data-queue-operation="resume"' in html
    client, fields = _confirmed(address, "table=task_jobs&queue=mail&operation=resume")
    status, html = post(address, "/queues/act", fields, client)
    assert status == 200 and "Resumed" in html
    assert _paused(own) == {}


def test_a_queue_operation_without_its_csrf_token_or_with_bad_input_changes_nothing(
    address: str, own: Engine
) -> None:
    client, fields = _confirmed(address, "table=task_jobs&queue=mail&operation=pause")
    forged = {k: v for k, v in fields.items() if k != "csrf"}
    assert post(address, "/queues/act", forged, client)[0] == 403
    assert post(address, "/queues/act", dict(fields, csrf="x" + fields["csrf"]), client)[0] == 403
    for query, expected in [("table=task_jobs&queue=&operation=pause", 400),
                            ("table=task_jobs&queue=mail&operation=drop", 400),
                            ("table=nope&queue=mail&operation=pause", 404),
                            ("table=task_jobs&queue=%00&operation=pause", 400)]:
        status, html = get(address, f"/queues/confirm?{query}")
        assert status == expected and "Traceback" not in html, (query, html)
        status, html = post(address, "/queues/act", dict(
            re.findall(r"(\w+)=([^&]*)", query)), client)
        assert status in (expected, 403) and "Traceback" not in html
    assert _paused(own) == {}


def test_read_only_offers_no_queue_operation_and_refuses_one(database: tuple[URL, Engine], own: Engine) -> None:
    with Session(own) as session, session.begin():
        jobs.enqueue(session, "noop", queue="mail")
    with serving(database[0], "--read-only") as address:
        assert "data-queue-operation" not in get(address, "/")[1]
        assert get(address, "/queues/confirm?table=task_jobs&queue=mail&operation=pause")[0] == 403
        assert post(address, "/queues/act", {"table": "task_jobs", "queue": "mail", "operation": "pause"})[0] == 403
    assert _paused(own) == {}


def _reporting() -> tuple[TaskRegistry, threading.Event]:
    registry, release = TaskRegistry(), threading.Event()

    @registry.task
    def exporting(job: TaskJob) -> None:
        report_progress(job, 0.5, "half <b>way</b>")
        release.wait(60)

    return registry, release


def test_the_workers_page_shows_a_live_worker_its_running_job_and_its_progress(address: str, own: Engine) -> None:
    status, html = get(address, "/workers")
    assert status == 200 and 'id="no-workers"' in html
    registry, release = _reporting()
    with Session(own) as session, session.begin():
        job_id = jobs.enqueue(session, "exporting").id
    worker = Worker(own, jobs, registry, poll_interval=0.05, name="dash-worker", lease=timedelta(seconds=3),
                    heartbeat_interval=timedelta(seconds=0.2))
    thread = threading.Thread(target=worker.run)
    thread.start()
    page: Callable[[], str] = lambda: get(address, "/workers")[1]  # noqa: E731
    try:
        wait_for(lambda: f'data-job="{job_id}"' in page(), 60, "the Workers page to list the running job")
        html = page()
        assert 'data-worker="dash-worker"' in html and "alive" in html and "50%" in html
        assert "half &lt;b&gt;way&lt;/b&gt;" in html  # escaped
        assert f'href="/jobs/task_jobs/{job_id}"' in html
        wait_for(lambda: 'id="progress"' in get(address, f"/jobs/task_jobs/{job_id}")[1], 60,
                 "the job page to show the heartbeat's progress")
    finally:
        release.set()
        worker.stop()
        thread.join(timeout=60)
    wait_for(lambda: 'id="no-workers"' in page(), 60, "the worker withdrawn at its stop")


def test_without_the_operations_tables_the_pages_say_so(create_database: Callable[[], URL]) -> None:
    url = create_database()
    engine = create_engine(url)
    jobapp.Base.metadata.create_all(engine)  # job tables only: no revision 0007 tables
    try:
        with Session(engine) as session, session.begin():
            jobs.enqueue(session, "noop", queue="mail")
        with serving(url) as address:
            status, html = get(address, "/workers")
            assert status == 200 and "no <code>sa_jobqueue_workers</code> table" in html
            status, html = get(address, "/")
            assert status == 200 and "data-queue-operation" not in html
            assert "no <code>sa_jobqueue_throughput</code> table" in html  # task_jobs deletes finished jobs
    finally:
        engine.dispose()
