"""The application the fault suite runs: a job table, an effects ledger, the
handlers, and a CLI that runs one worker process.

    python tests/chaos/chaosapp.py work URL --mode lease --concurrency 4 --lease 3 [--no-listen] [--pgbouncer]

The worker runs until SIGTERM/SIGINT, then prints its WorkerResult as JSON.

Each handler call first appends ``job_id attempt pid time`` to a run log of
its own process (``$CHAOS_RUNLOG/runs-<pid>.log``, written with one
``write(2)`` so that a SIGKILL loses nothing the kernel has), then writes one
``chaos_effects`` row in the job's own session. ``chaos_effects.job_id`` is
deliberately not unique: a job whose effect committed twice has two rows
there, instead of failing on a key. The run log tells how often a handler
started; the effects tell how often its database effect committed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, DateTime, Engine, Integer, create_engine, func, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sa_jobqueue import JobMixin, JobRepository, RetryPolicy, TaskRegistry, Worker  # noqa: E402
from sa_jobqueue.urls import psycopg_url  # noqa: E402


class Base(DeclarativeBase):
    pass


class ChaosJob(JobMixin, Base):
    """Completed jobs are deleted (the default): a finished job is either
    gone with exactly one effect, or ``dead``."""

    __tablename__ = "chaos_jobs"


class Effect(Base):
    """One row per committed run of a handler; ``job_id`` is not unique on purpose."""

    __tablename__ = "chaos_effects"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigInteger, index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.clock_timestamp())


class Batch(Base):
    """The ids of one enqueued batch, inserted in the batch's own transaction:
    after a failed commit, its presence tells whether the batch committed."""

    __tablename__ = "chaos_batches"
    batch: Mapped[int] = mapped_column(Integer, primary_key=True)
    ids: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))


jobs = JobRepository(ChaosJob)
tasks = TaskRegistry()
# Fast retries, so that a job failed by a fault (a killed connection) runs
# again within a second or two instead of the default 15 s.
FAST = RetryPolicy(base=timedelta(milliseconds=100), max_delay=timedelta(seconds=1), jitter=0.1)
STORM = RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0)
MAX_ATTEMPTS = 25

_runlog_fd: int | None = None


def _record_start(job: ChaosJob) -> None:
    global _runlog_fd
    directory = os.environ.get("CHAOS_RUNLOG")
    if not directory:
        return
    if _runlog_fd is None:
        _runlog_fd = os.open(Path(directory) / f"runs-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(_runlog_fd, f"{job.id} {job.attempts} {os.getpid()} {time.time():.6f}\n".encode())


HOLD_QUERY = "SELECT 'chaos-hold'"


def _run(job: ChaosJob, session: Session) -> None:
    _record_start(job)
    if job.payload.get("hold"):
        # Open the job's transaction on its connection before sleeping, so a
        # test can find this backend (its last query) and stall its connection.
        session.execute(text(HOLD_QUERY))
    time.sleep(float(job.payload.get("sleep", 0)))
    if job.attempts <= int(job.payload.get("fail", 0)):
        raise RuntimeError(f"planned failure at attempt {job.attempts}")
    session.add(Effect(job_id=job.id, attempt=job.attempts, pid=os.getpid()))
    session.flush()


@tasks.task(retry=FAST, max_attempts=MAX_ATTEMPTS)
def effect(job: ChaosJob, session: Session) -> None:
    """Sleep ``payload.sleep`` seconds (with ``payload.hold``: in an open transaction),
    fail the first ``payload.fail`` attempts, then write the effect."""
    _run(job, session)


@tasks.task(retry=STORM, max_attempts=MAX_ATTEMPTS)
def storm(job: ChaosJob, session: Session) -> None:
    """As ``effect``, retried at once after each failure."""
    _run(job, session)


def connect_args(*, pgbouncer: bool, application_name: str = "chaos-worker") -> dict[str, Any]:
    """The engine's libpq options: what the fault suite recommends (docs/operations.md)."""
    args: dict[str, Any] = {
        "connect_timeout": 5,
        # A vanished peer (host down, packets dropped) fails a connection within
        # keepalives_idle + interval * count = 11 s when idle, or tcp_user_timeout
        # when data sent stays unacknowledged.
        "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
        "tcp_user_timeout": 10_000,
        "application_name": application_name,
    }
    if pgbouncer:
        # PgBouncer before 1.21 cannot track prepared statements in transaction
        # pooling, and refuses the "options" startup parameter.
        args["prepare_threshold"] = None
    else:
        # A session stuck in a transaction (a client that stalled, froze or
        # vanished mid-job) gives its row locks back after 20 s.
        args["options"] = "-c idle_in_transaction_session_timeout=20s"
    return args


def make_engine(url: str, *, concurrency: int, pgbouncer: bool) -> Engine:
    return create_engine(
        psycopg_url(url), pool_size=concurrency + 1, max_overflow=2, pool_timeout=30,
        pool_pre_ping=True,
        connect_args=connect_args(pgbouncer=pgbouncer, application_name=f"chaos-worker-{os.getpid()}"),
    )


def _work(args: argparse.Namespace) -> None:
    engine = make_engine(args.url, concurrency=args.concurrency, pgbouncer=args.pgbouncer)
    worker = Worker(
        engine, jobs, tasks, concurrency=args.concurrency, mode=args.mode,
        lease=timedelta(seconds=args.lease), poll_interval=args.poll, listen=args.listen,
    )
    result = worker.run()
    print(json.dumps({"pid": os.getpid(), **asdict(result)}), flush=True)


def main() -> None:
    # SIGUSR1 dumps every thread's stack to the log: the harness sends it to a
    # worker that did not stop after SIGTERM before it kills it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    work = sub.add_parser("work")
    work.add_argument("url")
    work.add_argument("--mode", default="lease")
    work.add_argument("--concurrency", type=int, default=4)
    work.add_argument("--lease", type=float, default=3.0)
    work.add_argument("--poll", type=float, default=0.5)
    work.add_argument("--no-listen", dest="listen", action="store_false")
    work.add_argument("--pgbouncer", action="store_true")
    args = parser.parse_args()
    _work(args)


if __name__ == "__main__":
    main()
