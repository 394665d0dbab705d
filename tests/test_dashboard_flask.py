"""The dashboard as a Flask blueprint (docs/dashboard.md "Flask"): the same pages and actions
as the ASGI app, through Flask's own test client, against a real PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from flask import Flask
from jobapp import Base, TaskJob, emails, jobs
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session
from test_docs import DOCS, python_blocks, section

from sa_jobqueue import JobSpec, create_control_tables, paused_queues, resume_queue
from sa_jobqueue.dashboard.blueprint import dashboard_blueprint

LEASE = timedelta(seconds=60)


@pytest.fixture(scope="module")
def database(create_database: Callable[[], URL]) -> Iterator[Engine]:
    engine = create_engine(create_database())
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        jobs.enqueue_many(session, [JobSpec("resize", {"image": n}, queue="media") for n in range(3)])
        emails.enqueue(session, "send", {"to": "ada"}, extra={"tenant_id": 7})
    with Session(engine) as session, session.begin():
        [job] = jobs.claim(session, queues="media", lease=LEASE)
        jobs.fail(session, job, "Traceback (most recent call last):\nOSError: disk full", discard=True)
    yield engine
    engine.dispose()


def _app(engine: Engine, **options: Any) -> Flask:
    app = Flask(__name__)
    app.register_blueprint(dashboard_blueprint(engine, [jobs, emails], **options), url_prefix="/queue")
    return app


def _dead(engine: Engine) -> int:
    with Session(engine) as session:
        found = session.scalar(select(TaskJob.id).where(TaskJob.status == "dead"))
    assert found is not None
    return found


def test_the_pages_render_under_the_prefix(database: Engine) -> None:
    client = _app(database).test_client()
    overview = client.get("/queue/")
    assert overview.status_code == 200 and 'data-table="email_jobs"' in overview.text
    assert 'href="/queue/jobs?status=dead"' in overview.text
    listed = client.get("/queue/jobs?queue=media&status=pending")
    assert listed.status_code == 200 and len(re.findall(r'<tr data-job="', listed.text)) == 2
    shown = client.get(f"/queue/jobs/task_jobs/{_dead(database)}")
    assert shown.status_code == 200 and "OSError: disk full" in shown.text
    bad = client.get("/queue/jobs?status=bogus")
    assert bad.status_code == 400 and 'role="alert">status: ' in bad.text
    assert client.get("/queue/jobs/task_jobs/0").status_code == 404
    assert client.get("/queue/static/dashboard.js").status_code == 200


def test_an_action_needs_the_confirmations_token(database: Engine) -> None:
    client = _app(database).test_client()
    job_id = _dead(database)
    confirmation = client.get(f"/queue/confirm?table=task_jobs&action=retry&id={job_id}")
    assert confirmation.status_code == 200
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirmation.text))
    refused = client.post("/queue/act", data={k: v for k, v in fields.items() if k != "csrf"})
    assert refused.status_code == 403 and "CSRF token" in refused.text
    other = _app(database).test_client()  # another browser, and another app's key
    assert other.post("/queue/act", data=fields).status_code == 403
    done = client.post("/queue/act", data=fields)
    assert done.status_code == 200 and "1 job(s) changed" in done.text
    with Session(database) as session:
        assert session.get(TaskJob, job_id).status == "pending"  # type: ignore[union-attr]


def test_read_only_and_authorize_refuse(database: Engine) -> None:
    read_only = _app(database, read_only=True).test_client()
    assert read_only.get("/queue/confirm?table=task_jobs&action=delete&status=pending").status_code == 403
    assert read_only.post("/queue/act", data={"table": "task_jobs", "action": "delete"}).status_code == 403
    closed = _app(database, authorize=lambda request: request.headers.get("X-Admin") == "yes").test_client()
    assert closed.get("/queue/jobs").status_code == 403
    assert closed.get("/queue/jobs", headers={"X-Admin": "yes"}).status_code == 200
    assert closed.get("/queue/events").status_code == 403
    with Session(database) as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 3


def test_the_event_stream_opens(database: Engine) -> None:
    response = _app(database, listen=False).test_client().get("/queue/events", buffered=False)
    try:
        assert response.status_code == 200 and response.mimetype == "text/event-stream"
        assert next(iter(response.response)) == b"retry: 2000\n\n"  # type: ignore[call-overload]
    finally:
        response.close()


def test_the_flask_example_registers_the_blueprint(database: Engine) -> None:
    (block,) = python_blocks(section(DOCS / "dashboard.md", "## Flask"))
    app = Flask(__name__)
    namespace: dict[str, Any] = {"app": app, "engine": database, "emails": emails, "reports": jobs}
    exec(compile(block, "docs/dashboard.md", "exec"), namespace)
    assert app.test_client().get("/queue/jobs?table=email_jobs").status_code == 200


def test_the_workers_page_and_a_queue_pause_through_the_blueprint(database: Engine) -> None:
    create_control_tables(database)
    client = _app(database).test_client()
    workers = client.get("/queue/workers")
    assert workers.status_code == 200 and 'id="no-workers"' in workers.text
    confirmation = client.get("/queue/queues/confirm?table=task_jobs&queue=media&operation=pause")
    assert confirmation.status_code == 200
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirmation.text))
    assert client.post("/queue/queues/act", data={k: v for k, v in fields.items() if k != "csrf"}).status_code == 403
    done = client.post("/queue/queues/act", data=fields)
    assert done.status_code == 200 and "Paused" in done.text
    with Session(database) as session:
        assert paused_queues(session) == {"task_jobs": {"media"}}
        resume_queue(session, jobs, "media")
        session.commit()
    assert 'data-queue-operation="pause"' in client.get("/queue/").text
