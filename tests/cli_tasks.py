"""A task registry and a worker factory for the CLI tests (tests/test_cli.py).

``sa-jobqueue worker cli_tasks:tasks`` runs ``record``, which writes a row of
``cli_done`` in the job's transaction; ``cli_tasks:make_worker`` is the same
as a zero-argument worker factory reading ``DATABASE_URL``; ``async_tasks``
and ``make_async_worker`` are the same for the asyncio worker.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading

from sqlalchemy import BigInteger, String, create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sa_jobqueue import JobContext, JobRepository, TaskRegistry, Worker, psycopg_url
from sa_jobqueue.aio import AsyncWorker
from sa_jobqueue.default import Job


class Base(DeclarativeBase):
    pass


class Done(Base):
    """One row per job whose handler committed."""

    __tablename__ = "cli_done"
    job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    note: Mapped[str | None] = mapped_column(String(100))
    # Whether the worker's process had frozen its start-up objects (gc.freeze) when the job ran.
    frozen: Mapped[bool | None]


tasks = TaskRegistry()


@tasks.task
def record(job: Job, session: Session) -> None:
    session.add(Done(job_id=job.id, note=(job.payload or {}).get("note"), frozen=gc.get_freeze_count() > 0))


@tasks.task(timeout=0.2, max_attempts=1)
def stuck(job: Job) -> None:
    """Hangs in Python, past its deadline: nothing on the server to cancel."""
    threading.Event().wait(3600)


#: Typed tasks bound to the default job table: ``enqueue greet --tasks cli_tasks:typed_tasks --arg name=ada``.
typed_tasks = TaskRegistry(repository=JobRepository(Job))


@typed_tasks.task(queue="typed", priority=2)
def greet(session: Session, ctx: JobContext, name: str, times: int = 1) -> None:
    session.add(Done(job_id=ctx.id, note=f"{name} x{times}"))


async_tasks = TaskRegistry()


@async_tasks.task(name="record")
async def record_async(job: Job, session: AsyncSession) -> None:
    """``record`` as an async def handler, on the job's AsyncSession."""
    session.add(Done(job_id=job.id, note=(job.payload or {}).get("note"), frozen=gc.get_freeze_count() > 0))


@async_tasks.task
async def hang(job: Job) -> None:
    """Waits (on the event loop) until the worker cancels it."""
    await asyncio.Event().wait()


def make_async_worker() -> AsyncWorker:
    engine = create_async_engine(psycopg_url(os.environ["DATABASE_URL"]))
    return AsyncWorker(engine, JobRepository(Job), async_tasks, concurrency=20)


def make_worker() -> Worker:
    engine = create_engine(psycopg_url(os.environ["DATABASE_URL"]))
    return Worker(engine, JobRepository(Job), tasks, concurrency=2)


def broken_factory() -> Worker:
    raise RuntimeError("no configuration here")


def not_a_worker() -> object:
    return tasks
