"""The dashboard's actions over HTTP (docs/dashboard.md "Actions"): through a confirmation
page whose form carries a CSRF token, with the library's verbs, refused in read-only mode;
and the edits they use (sa_jobqueue.edits), against a real PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from dashboard_server import browser_like, get, post, serving
from jobapp import TaskJob, jobs
from sqlalchemy import Engine, func, select
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from sa_jobqueue import InvalidArgumentError, JobSpec
from sa_jobqueue.edits import delete_job, run_now, set_priority

LEASE = timedelta(seconds=60)


@pytest.fixture(scope="module")
def database(module_database: tuple[URL, Engine]) -> tuple[URL, Engine]:
    return module_database


@pytest.fixture(scope="module")
def address(database: tuple[URL, Engine]) -> Iterator[str]:
    with serving(database[0]) as served:
        yield served


@pytest.fixture(scope="module")
def read_only(database: tuple[URL, Engine]) -> Iterator[str]:
    with serving(database[0], "--read-only") as served:
        yield served


@pytest.fixture
def own(database: tuple[URL, Engine]) -> Iterator[Engine]:
    """This module's database (its task_jobs emptied after each test)."""
    yield database[1]
    with database[1].begin() as conn:
        conn.execute(TaskJob.__table__.delete())


def _statuses(engine: Engine, queue: str) -> dict[str, int]:
    with Session(engine) as session:
        rows = session.execute(select(TaskJob.status, func.count()).where(TaskJob.queue == queue)
                               .group_by(TaskJob.status)).all()
    return {status: count for status, count in rows}


def _dead(engine: Engine, queue: str, n: int) -> list[int]:
    with Session(engine) as session, session.begin():
        jobs.enqueue_many(session, [JobSpec("report", {"n": i}, queue=queue) for i in range(n)])
    with Session(engine) as session, session.begin():
        claimed = jobs.claim(session, queues=queue, limit=n, lease=LEASE)
        for job in claimed:
            jobs.fail(session, job, "boom", discard=True)
    return [job.id for job in claimed]


def _confirmed(address: str, query: str) -> tuple[Any, dict[str, str]]:
    """Open the confirmation page of ``query`` as a browser would: its client and its form's fields."""
    client = browser_like()
    status, html = get(address, f"/confirm?{query}", client)
    assert status == 200, html
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', html))
    assert fields.get("csrf")
    return client, fields


def test_retry_every_dead_job_matching_the_filter(address: str, own: Engine) -> None:
    _dead(own, "reports", 3)
    with Session(own) as session, session.begin():
        jobs.enqueue(session, "report", queue="reports")  # pending: matches no "dead" filter
    client, fields = _confirmed(address, "table=task_jobs&action=retry&status=dead&queue=reports")
    assert "Retry 3 job(s)?" in get(address, "/confirm?table=task_jobs&action=retry&status=dead&queue=reports",
                                    client)[1]
    status, html = post(address, "/act", fields, client)
    assert status == 200 and "3 job(s) changed; 0 left" in html
    assert _statuses(own, "reports") == {"pending": 4}


def test_an_action_over_a_mixed_filter_changes_only_what_it_may(address: str, own: Engine) -> None:
    dead = _dead(own, "mixed", 2)
    with Session(own) as session, session.begin():
        jobs.enqueue_many(session, [JobSpec("report", queue="mixed") for _ in range(3)])
    client, fields = _confirmed(address, "table=task_jobs&action=run_now&queue=mixed")
    status, html = post(address, "/act", fields, client)
    assert "3 job(s) changed; 2 left as they were (it changes pending jobs only)" in html
    assert _statuses(own, "mixed") == {"pending": 3, "dead": 2}
    client, fields = _confirmed(address, f"table=task_jobs&action=delete&id={dead[0]}")
    assert post(address, "/act", fields, client)[1].count("1 job(s) changed") == 1
    assert _statuses(own, "mixed") == {"pending": 3, "dead": 1}


def test_change_priority_and_cancel_one_job(address: str, own: Engine) -> None:
    with Session(own) as session, session.begin():
        job = jobs.enqueue(session, "report", queue="one", delay=timedelta(hours=1))
    client, fields = _confirmed(address, f"table=task_jobs&action=priority&id={job.id}")
    assert post(address, "/act", fields | {"priority": "-7"}, client)[0] == 200
    for bad in ("high", "40000", "", "1.5"):
        status, html = post(address, "/act", fields | {"priority": bad}, client)
        assert status == 400 and "priority: must be a whole number" in html
    client, fields = _confirmed(address, f"table=task_jobs&action=cancel&id={job.id}")
    assert post(address, "/act", fields, client)[0] == 200
    with Session(own) as session:
        assert session.execute(select(TaskJob.priority, TaskJob.status).where(TaskJob.id == job.id)).one() == (
            -7, "cancelled")


@pytest.mark.parametrize("forge", ["no token", "wrong token", "another browser's token", "no cookie"])
def test_a_post_without_the_right_csrf_token_is_refused(address: str, own: Engine, forge: str) -> None:
    [job_id] = _dead(own, "csrf", 1)
    client, fields = _confirmed(address, f"table=task_jobs&action=retry&id={job_id}")
    if forge == "no token":
        fields.pop("csrf")
    elif forge == "wrong token":
        fields["csrf"] = "0" * 64
    elif forge == "another browser's token":
        _, other = _confirmed(address, f"table=task_jobs&action=retry&id={job_id}")
        fields["csrf"] = other["csrf"]
    else:
        client = None
    status, html = post(address, "/act", fields, client)
    assert status == 403 and "CSRF token" in html
    assert _statuses(own, "csrf") == {"dead": 1}


def test_read_only_offers_no_action_and_refuses_one(read_only: str, own: Engine) -> None:
    [job_id] = _dead(own, "ro", 1)
    status, html = get(read_only, f"/jobs/task_jobs/{job_id}")
    assert status == 200 and 'class="action"' not in html
    status, html = get(read_only, "/jobs?queue=ro")
    assert status == 200 and "/confirm?" not in html
    assert get(read_only, f"/confirm?table=task_jobs&action=retry&id={job_id}")[0] == 403
    status, html = post(read_only, "/act", {"table": "task_jobs", "action": "retry", "id": str(job_id)})
    assert status == 403 and "read-only" in html
    assert _statuses(own, "ro") == {"dead": 1}


@pytest.mark.parametrize(("query", "status", "message"), [
    ("table=task_jobs&action=explode", 400, "action: must be one of"),
    ("table=nope&action=retry", 404, "not a job table"),
    ("table=task_jobs&action=retry&status=bogus", 400, "status: must be one of"),
    ("table=task_jobs&action=retry&payload=$.x%20==", 400, "payload: not a SQL/JSON path"),
])
def test_a_bad_action_or_filter_is_a_4xx_and_changes_nothing(address: str, own: Engine, query: str,
                                                            status: int, message: str) -> None:
    _dead(own, "bad", 1)
    got, html = get(address, f"/confirm?{query}", browser_like())
    assert got == status and message in html and "Traceback" not in html
    assert _statuses(own, "bad") == {"dead": 1}


# -- the edits themselves


def test_the_edits_leave_a_running_job_alone(own: Engine) -> None:
    with Session(own) as session, session.begin():
        job = jobs.enqueue(session, "report", queue="edits")
    with Session(own) as session, session.begin():
        [running] = jobs.claim(session, queues="edits", lease=LEASE)
        assert not run_now(session, jobs, running.id)
        assert not set_priority(session, jobs, running.id, 5)
        assert not delete_job(session, jobs, running.id)
    assert _statuses(own, "edits") == {"running": 1} and running.id == job.id


@pytest.mark.parametrize(("call", "parameter"), [
    (lambda s: set_priority(s, jobs, 1, 40_000), "priority"),
    (lambda s: set_priority(s, jobs, 1, True), "priority"),
    (lambda s: run_now(s, jobs, "1"), "job_id"),
    (lambda s: delete_job(None, jobs, 1), "session"),
])
def test_the_edits_refuse_bad_input(own: Engine, call: Callable[[Session], object], parameter: str) -> None:
    with Session(own) as session, session.begin():
        with pytest.raises(InvalidArgumentError) as refused:
            call(session)
    assert refused.value.parameter == parameter
