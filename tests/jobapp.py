"""The application the tests run: job models, a ledger, handlers, and a CLI
that runs a worker or a claimer in a separate process.

    python tests/jobapp.py work  URL --mode lease --concurrency 2 [--until-empty]
    python tests/jobapp.py claim URL --limit 5 --rounds 50

``work`` prints its WorkerResult as JSON on exit; ``claim`` prints the ids
each claim returned, one JSON list per line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

from sqlalchemy import BigInteger, String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sa_jobqueue import JobMixin, JobRepository, RetryJob, RetryPolicy, TaskRegistry, Worker  # noqa: E402
from sa_jobqueue.urls import psycopg_url  # noqa: E402


class Base(DeclarativeBase):
    pass


class TaskJob(JobMixin, Base):
    """The main job table of the tests."""

    __tablename__ = "task_jobs"


class EmailJob(JobMixin, Base):
    """A second job table with a user column, on the same Base."""

    __tablename__ = "email_jobs"
    tenant_id: Mapped[int | None]


class ReportJob(JobMixin, Base):
    """A job table that keeps completed jobs."""

    __tablename__ = "report_jobs"
    __keep_done__ = True


class Ledger(Base):
    """One row per job whose handler committed; job_id is unique."""

    __tablename__ = "ledger"
    job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    note: Mapped[str | None] = mapped_column(String(100))


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(50))


jobs = JobRepository(TaskJob)
emails = JobRepository(EmailJob)
reports = JobRepository(ReportJob)

QUICK = RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0)
tasks = TaskRegistry()


@tasks.task
def ledger(job: TaskJob, session: Session) -> None:
    """Write the ledger row in the job's own session."""
    session.add(Ledger(job_id=job.id))
    session.flush()


@tasks.task
def noop(job: TaskJob) -> None:
    pass


@tasks.task
def slow(job: TaskJob, session: Session) -> None:
    """Announce the start in a marker file, sleep, then write the ledger."""
    marker = job.payload.get("marker")
    if marker:
        Path(marker).write_text(str(os.getpid()))
    if job.attempts == 1 or not job.payload.get("first_attempt_only"):
        time.sleep(job.payload["seconds"])
    session.add(Ledger(job_id=job.id, note=f"attempt {job.attempts}"))
    session.flush()


@tasks.task
def hang_first(job: TaskJob, session: Session) -> None:
    """First attempt: announce and hang (the test kills the worker). Later: ledger."""
    marker = Path(job.payload["marker"])
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        time.sleep(600)
    session.add(Ledger(job_id=job.id, note=f"attempt {job.attempts}"))
    session.flush()


@tasks.task
def kill_worker(job: TaskJob) -> None:
    """Kills its own worker process, every time."""
    os.kill(os.getpid(), signal.SIGKILL)


@tasks.task(retry=QUICK)
def flaky(job: TaskJob, session: Session) -> None:
    """Fails its first ``failures`` attempts, then writes the ledger."""
    if job.attempts <= job.payload["failures"]:
        raise RuntimeError(f"flaky failure {job.attempts}")
    session.add(Ledger(job_id=job.id, note=f"attempt {job.attempts}"))
    session.flush()


@tasks.task(retry=QUICK, max_attempts=3)
def always_fails(job: TaskJob, session: Session) -> None:
    session.add(Ledger(job_id=job.id))  # rolled back with the failure
    session.flush()
    raise ValueError("always fails")


@tasks.task
def retry_later(job: TaskJob) -> None:
    raise RetryJob("not yet", delay=timedelta(hours=1))


@tasks.task
def hang(job: TaskJob, session: Session) -> None:
    """Announce the start in the marker file given, then hang (a stuck handler)."""
    with open(job.payload["marker"], "a") as marker:
        marker.write(f"{job.id}\n")
    time.sleep(3600)


def _work(args: argparse.Namespace) -> None:
    engine = create_engine(psycopg_url(args.url), pool_size=args.concurrency + 1)
    worker = Worker(
        engine, [jobs, emails, reports], tasks, queues=args.queues.split(","),
        concurrency=args.concurrency, mode=args.mode,
        lease=timedelta(seconds=args.lease), poll_interval=args.poll, batch_size=args.batch_size,
        shutdown_timeout=timedelta(seconds=args.shutdown_timeout),
    )
    result = worker.run(until_empty=args.until_empty)
    print(json.dumps(asdict(result)), flush=True)


def _claim(args: argparse.Namespace) -> None:
    engine = create_engine(psycopg_url(args.url))
    with Session(engine) as session:
        for _ in range(args.rounds):
            with session.begin():
                ids = [job.id for job in jobs.claim(session, limit=args.limit, queues=["default"])]
            print(json.dumps(ids), flush=True)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("sa_jobqueue.worker").setLevel(logging.INFO)  # tests read what a stop logs
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    work = sub.add_parser("work")
    work.add_argument("url")
    work.add_argument("--mode", default="lease")
    work.add_argument("--concurrency", type=int, default=2)
    work.add_argument("--lease", type=float, default=60.0)
    work.add_argument("--poll", type=float, default=0.2)
    work.add_argument("--queues", default="default")
    work.add_argument("--until-empty", action="store_true")
    work.add_argument("--batch-size", type=int, default=None)
    work.add_argument("--shutdown-timeout", type=float, default=30.0)
    claim = sub.add_parser("claim")
    claim.add_argument("url")
    claim.add_argument("--limit", type=int, default=5)
    claim.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    {"work": _work, "claim": _claim}[args.command](args)


if __name__ == "__main__":
    main()
