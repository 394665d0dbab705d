"""sa_jobqueue.contrib.flask: a real Flask app with Flask-SQLAlchemy on the test PostgreSQL.

The app has a database of its own holding the default job table and a users
table of Flask-SQLAlchemy's. A request enqueues on ``db.session``; the worker
runs each job in the app context with ``db.session`` bound to the job's session.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from flask import Flask, current_app, request
from flask.testing import FlaskCliRunner
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import String, create_engine, select, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sa_jobqueue import InvalidArgumentError, JobRepository, TaskRegistry
from sa_jobqueue.contrib.flask import EXTENSION, JobQueue
from sa_jobqueue.default import Job


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
jobqueue = JobQueue()
repo = JobRepository(Job)


class User(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200))
    welcomed_by: Mapped[str | None] = mapped_column(String(200), default=None)


class Note(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_notes"
    id: Mapped[int] = mapped_column(primary_key=True)
    text: Mapped[str] = mapped_column(String(200))


SEEN: list[dict[str, Any]] = []


@jobqueue.tasks.task
def send_welcome(job: Job, session: Session) -> None:
    """Reads the app's config and writes through db.session (the job's session here)."""
    user = db.session.get(User, job.payload["user_id"])
    assert user is not None
    user.welcomed_by = current_app.config["WELCOME_FROM"]
    SEEN.append({"task": "send_welcome", "same_session": db.session() is session, "app": current_app.name})


@jobqueue.tasks.task
def write_note(job: Job) -> None:
    """Takes no session: db.session is still the job's, its writes commit with the completion."""
    db.session.add(Note(text=f"{current_app.config['WELCOME_FROM']}: {job.payload['text']}"))


@jobqueue.tasks.task(max_attempts=1)
def write_then_fail(job: Job, session: Session) -> None:
    session.add(Note(text="never committed"))
    db.session.add(Note(text="never committed either"))
    raise RuntimeError("boom")


@jobqueue.tasks.task
def chain(job: Job) -> None:
    """Enqueues from inside a job: on db.session, i.e. in the job's transaction."""
    jobqueue.enqueue("write_note", {"text": "chained"})


def create_app(url: str, name: str = "flask_jobs_test", welcome_from: str = "the test app") -> Flask:
    app = Flask(name)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, WELCOME_FROM=welcome_from, PROPAGATE_EXCEPTIONS=False)
    db.init_app(app)
    jobqueue.init_app(app, db)

    @app.post("/signup")
    def signup() -> dict[str, Any]:
        user = User(email=request.form["email"])
        db.session.add(user)
        db.session.flush()
        job = jobqueue.enqueue("send_welcome", {"user_id": user.id}, queue="signup")
        if request.form.get("fail"):
            raise RuntimeError("the request fails after its writes")
        db.session.commit()
        return {"user_id": user.id, "job_id": job.id}

    return app


@pytest.fixture(scope="module")
def app(create_database: Callable[[], URL]) -> Iterator[Flask]:
    url = create_database()
    engine = create_engine(url)
    Job.metadata.create_all(engine)
    engine.dispose()
    app = create_app(url.render_as_string(hide_password=False))
    with app.app_context():
        db.create_all()
    yield app
    with app.app_context():
        db.engine.dispose()


@pytest.fixture(autouse=True)
def _empty(request: pytest.FixtureRequest) -> Iterator[None]:
    SEEN.clear()
    yield
    if "app" in request.fixturenames:
        app: Flask = request.getfixturevalue("app")
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(text("TRUNCATE sa_jobqueue_jobs, flask_users, flask_notes"))


def _rows(app: Flask) -> tuple[list[User], list[Job], list[str]]:
    with app.app_context():
        users = list(db.session.scalars(select(User).order_by(User.id)))
        jobs = list(db.session.scalars(select(Job).order_by(Job.id)))
        notes = list(db.session.scalars(select(Note.text).order_by(Note.id)))
        db.session.expunge_all()
    return users, jobs, notes


def test_request_commits_the_row_and_the_job(app: Flask) -> None:
    response = app.test_client().post("/signup", data={"email": "ada@example.com"})
    assert response.status_code == 200, response.data
    body = response.get_json()
    users, jobs, _ = _rows(app)
    assert [u.email for u in users] == ["ada@example.com"]
    assert [(j.id, j.task, j.queue, j.status, j.payload) for j in jobs] == [
        (body["job_id"], "send_welcome", "signup", "pending", {"user_id": body["user_id"]})
    ]


def test_failed_request_commits_neither(app: Flask) -> None:
    response = app.test_client().post("/signup", data={"email": "bob@example.com", "fail": "1"})
    assert response.status_code == 500
    assert _rows(app) == ([], [], [])


def test_worker_runs_jobs_in_the_app_context(app: Flask) -> None:
    client = app.test_client()
    user_id = client.post("/signup", data={"email": "ada@example.com"}).get_json()["user_id"]
    with app.app_context():
        jobqueue.enqueue("write_note", {"text": "hello"})
        jobqueue.enqueue("write_then_fail")
        jobqueue.enqueue("chain")
        db.session.commit()

    worker = jobqueue.worker(app, queues=["default", "signup"], concurrency=2, poll_interval=0.1)
    result = worker.run(until_empty=True)

    assert (result.completed, result.dead, result.retried, result.lost) == (4, 1, 0, 0)
    assert SEEN == [{"task": "send_welcome", "same_session": True, "app": "flask_jobs_test"}]
    users, jobs, notes = _rows(app)
    assert [(u.id, u.welcomed_by) for u in users] == [(user_id, "the test app")]
    # The failing handler's writes (job session and db.session alike) were rolled back.
    assert sorted(notes) == ["the test app: chained", "the test app: hello"]
    # Completed jobs leave the table; the dead one stays.
    assert [(j.task, j.status) for j in jobs] == [("write_then_fail", "dead")]


def test_worker_works_in_transaction_mode(app: Flask) -> None:
    with app.app_context():
        for n in range(3):
            jobqueue.enqueue("write_note", {"text": f"n{n}"})
        db.session.commit()
        # Inside an app context the app is found by itself.
        worker = jobqueue.worker(mode="transaction", batch_size=3, listen=False, poll_interval=0.1)
    result = worker.run(until_empty=True)
    assert result.completed == 3
    assert sorted(_rows(app)[2]) == [f"the test app: n{n}" for n in range(3)]


def test_flask_jobs_commands(app: Flask) -> None:
    runner = app.test_cli_runner()
    result = runner.invoke(args=["jobs", "enqueue", "write_note", "--payload", '{"text": "from the cli"}'])
    assert result.exit_code == 0, (result.output, result.exception)
    job_id = int(result.output.strip())

    result = runner.invoke(args=["jobs", "stats"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert any(line.split()[:3] == ["default", "pending", "1"] for line in result.output.splitlines())

    result = runner.invoke(args=["jobs", "jobs", "show", str(job_id)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "write_note" in result.output

    assert gc.get_freeze_count() == 0
    try:
        result = runner.invoke(args=["jobs", "worker", "--until-empty", "--no-listen", "--concurrency", "1"])
        # The command froze what the process had built before running its worker (here, the test's own).
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this process is the test run's, not a worker's
    assert result.exit_code == 0, (result.output, result.exception)
    assert json.loads(result.output.strip().splitlines()[-1]) == {
        "completed": 1, "retried": 0, "dead": 0, "lost": 0, "cancelled": 0, "handed_back": 0,
    }
    assert _rows(app)[2] == ["the test app: from the cli"]

    result = runner.invoke(args=["jobs", "health"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "pending 0" in result.output and "sajq_test_" in result.output

    result = runner.invoke(args=["jobs", "--help"])
    assert result.exit_code == 0
    for command in ("worker", "enqueue", "stats", "jobs", "retry", "cancel", "purge", "reap", "health"):
        assert command in result.output


def test_one_jobqueue_on_two_apps(app: Flask) -> None:
    """An app factory called twice: each app's jobs run in that app's context, on its engine."""
    with app.app_context():
        url = db.engine.url.render_as_string(hide_password=False)
    other = create_app(url, name="second_app", welcome_from="the second app")
    try:
        with other.app_context():
            jobqueue.enqueue("write_note", {"text": "hi"})
            db.session.commit()
        assert jobqueue.worker(other, listen=False, poll_interval=0.1).run(until_empty=True).completed == 1
        assert _rows(app)[2] == ["the second app: hi"]
        result = other.test_cli_runner().invoke(args=["jobs", "stats", "--model", "sa_jobqueue.default:Job"])
        assert result.exit_code == 0, (result.output, result.exception)
        assert result.output.strip() == "no jobs in sa_jobqueue_jobs"
    finally:
        with other.app_context():
            db.engine.dispose()


def _cli_runner(app: Flask) -> FlaskCliRunner:
    try:
        return FlaskCliRunner(app, mix_stderr=False)  # click 8.1
    except TypeError:
        return FlaskCliRunner(app)  # click 8.2+: stderr is kept apart


@pytest.mark.parametrize(
    ("args", "code", "contains"),
    [
        (["jobs", "cancel", "999999"], 1, "job 999999 not found"),
        (["jobs", "enqueue", "x", "--payload", "{not json"], 2, "--payload: not valid JSON"),
        (["jobs", "jobs", "show", "abc"], 2, "Invalid value for 'ID': 'abc' is not a valid integer."),
        (["jobs", "enqueue"], 2, "Missing argument 'TASK'."),
        (["jobs", "frob"], 2, "No such command 'frob'."),
        (["jobs", "worker", "--concurrency", "0"], 2, "Invalid value for '--concurrency'"),
    ],
)
def test_flask_jobs_errors_are_one_line(app: Flask, args: list[str], code: int, contains: str) -> None:
    """As in sa-jobqueue, click's usage errors included, under Flask's own command group."""
    result = _cli_runner(app).invoke(args=args)
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert contains in lines[0]


def test_setup_mistakes(app: Flask) -> None:
    assert isinstance(app.extensions[EXTENSION].jobqueue, JobQueue)
    with pytest.raises(RuntimeError, match="app context"):
        jobqueue.enqueue("write_note", {"text": "no app"})
    with pytest.raises(InvalidArgumentError, match="already initialised"):
        jobqueue.init_app(app, db)
    with pytest.raises(InvalidArgumentError, match="db.init_app"):
        JobQueue(Flask("bare"), SQLAlchemy())
    with pytest.raises(InvalidArgumentError, match="tasks"):
        JobQueue(tasks=object())  # type: ignore[arg-type]
    other = JobQueue(tasks=TaskRegistry())
    with pytest.raises(RuntimeError, match="not initialised"):
        other.worker(app)


def test_the_app_context_tasks_keep_every_option_of_the_tasks(app: Flask) -> None:
    """Regression: the wrapped tasks once dropped ``timeout`` (and so ran without a deadline)."""
    tasks = TaskRegistry()
    tasks.register("slow", lambda job, session: None, timeout=timedelta(seconds=3), max_attempts=2,
                   batch_complete=False, group_commit=True)
    other, other_db = Flask("options"), SQLAlchemy(model_class=Base)
    other.config["SQLALCHEMY_DATABASE_URI"] = app.config["SQLALCHEMY_DATABASE_URI"]
    other_db.init_app(other)
    wrapped = JobQueue(tasks=tasks)
    wrapped.init_app(other, other_db)
    (task,) = list(wrapped.app_tasks(other))
    assert (task.timeout, task.max_attempts, task.batch_complete, task.group_commit) == (
        timedelta(seconds=3), 2, False, True)


def test_core_never_imports_flask() -> None:
    import subprocess
    import sys

    code = "import sys, sa_jobqueue, sa_jobqueue.cli; print(sorted(m for m in sys.modules if m.startswith('flask')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
