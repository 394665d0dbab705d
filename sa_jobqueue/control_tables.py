"""The tables of a deployment's operations: live workers and paused queues.

Two small tables that every job table of a database shares, created by the
Alembic revision 0007 (or :func:`create_control_tables`):

* ``sa_jobqueue_workers``: one row per running worker process, written by its
  presence beat (:mod:`sa_jobqueue.presence`); the dashboard's Workers page,
  ``sa-jobqueue workers``, ``health`` and the Prometheus collector read it.
* ``sa_jobqueue_paused_queues``: one row per paused queue of a job table
  (:mod:`sa_jobqueue.pausing`); workers stop claiming from it within one poll
  interval.
* ``sa_jobqueue_throughput``: per job table, queue and minute, the jobs that
  workers completed and the attempts that failed, added by each worker's
  presence beat (:mod:`sa_jobqueue.throughput`); the dashboard's chart.

Neither is on a job's path: a worker that cannot write or read them (the
revision was not run yet) logs it once and runs its jobs as before, with no
presence and nothing paused.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import DateTime, Engine, Integer, String, Table, Text, func
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from .errors import InvalidArgumentError
from .states import NAME_LENGTH

__all__ = [
    "THROUGHPUT", "THROUGHPUT_TABLE", "ControlBase", "PAUSED", "PAUSED_TABLE", "WORKERS", "WORKERS_TABLE",
    "create_control_tables",
]

WORKERS_TABLE = "sa_jobqueue_workers"
PAUSED_TABLE = "sa_jobqueue_paused_queues"
THROUGHPUT_TABLE = "sa_jobqueue_throughput"


class ControlBase(DeclarativeBase):
    """The declarative base of the operations tables (a target of the project's Alembic environment)."""


class WorkerRow(ControlBase):
    """A worker process as its last presence beat described it."""

    __tablename__ = WORKERS_TABLE

    # Random per run of a worker: two processes given the same name are two rows.
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    driver: Mapped[str] = mapped_column(String(16))  # 'threads' or 'asyncio'
    mode: Mapped[str] = mapped_column(String(16))
    concurrency: Mapped[int] = mapped_column(Integer)
    tables: Mapped[list[str]] = mapped_column(ARRAY(Text))
    queues: Mapped[list[str]] = mapped_column(ARRAY(Text))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    beat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    # Past this instant without a beat the worker counts as gone (three beats missed).
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The jobs its handlers run, as of the beat: [{table, id, task, queue, since, progress}].
    running: Mapped[Any] = mapped_column(JSONB)


class PausedQueue(ControlBase):
    """A queue of a job table that workers do not claim from."""

    __tablename__ = PAUSED_TABLE

    job_table: Mapped[str] = mapped_column(String(63), primary_key=True)
    queue: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    paused_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    paused_by: Mapped[str | None] = mapped_column(String(255))


class ThroughputRow(ControlBase):
    """Jobs of one queue of a job table that workers finished in one minute."""

    __tablename__ = THROUGHPUT_TABLE

    job_table: Mapped[str] = mapped_column(String(63), primary_key=True)
    queue: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    minute: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    completed: Mapped[int] = mapped_column(Integer)
    failed: Mapped[int] = mapped_column(Integer)  # attempts that failed: retried, dead or timed out


WORKERS = cast(Table, WorkerRow.__table__)
THROUGHPUT = cast(Table, ThroughputRow.__table__)
PAUSED = cast(Table, PausedQueue.__table__)


def create_control_tables(bind: Engine | Connection) -> None:
    """Create ``sa_jobqueue_workers``, ``sa_jobqueue_paused_queues`` and ``sa_jobqueue_throughput`` unless they exist
    (the Alembic revision 0007 does the same)."""
    if not isinstance(bind, (Engine, Connection)):
        raise InvalidArgumentError("bind", "must be an Engine or a Connection")
    ControlBase.metadata.create_all(bind, checkfirst=True)
