"""Paused queues: a queue of a job table that no worker claims from.

::

    pause_queue(session, emails, "newsletters", by="ops: mail provider down")
    session.commit()                  # workers stop claiming within one poll interval
    resume_queue(session, emails, "newsletters")
    session.commit()

A pause is a row of ``sa_jobqueue_paused_queues`` (revision 0007). Each
worker reads the paused queues of its tables once per ``poll_interval`` and
leaves them out of its claims, so a pause reaches every process of a
deployment within one poll interval of its commit. What a caller may rely on:

* pausing changes no job: pending jobs stay pending (and keep their place),
  running jobs run to their end, and enqueueing into a paused queue works;
* the verbs never commit: a pause commits with the caller's transaction;
* pausing twice, or resuming a queue that is not paused, is no error
  (the return value says whether anything changed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Table, delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .checks import check_name, check_session
from .control_tables import PAUSED
from .errors import InvalidArgumentError
from .mixin import job_table

__all__ = ["pause_queue", "paused_queues", "resume_queue"]


def pause_queue(session: Any, jobs: Any, queue: str, *, by: str | None = None) -> bool:
    """Pause ``queue`` of the job table of ``jobs`` (a JobRepository or a JobMixin
    model); ``by`` says who or why, for the dashboard. True when it was not paused."""
    session = check_session(session)
    table = table_of(jobs)
    queue = check_name("queue", queue)
    reason = None if by is None else check_name("by", by, 255)
    statement = (pg_insert(PAUSED).values(job_table=table.name, queue=queue, paused_by=reason)
                 .on_conflict_do_nothing().returning(PAUSED.c.queue))
    return session.execute(statement).first() is not None


def resume_queue(session: Any, jobs: Any, queue: str) -> bool:
    """Resume ``queue`` of the job table of ``jobs``; True when it was paused."""
    session = check_session(session)
    table = table_of(jobs)
    queue = check_name("queue", queue)
    statement = (delete(PAUSED).where(PAUSED.c.job_table == table.name, PAUSED.c.queue == queue)
                 .returning(PAUSED.c.queue))
    return session.execute(statement).first() is not None


def paused_queues(session: Any, tables: Iterable[str] | None = None) -> dict[str, set[str]]:
    """The paused queues by job table name: of ``tables``, or of every table."""
    session = check_session(session)
    statement = select(PAUSED.c.job_table, PAUSED.c.queue)
    if tables is not None:
        statement = statement.where(PAUSED.c.job_table.in_(list(tables)))
    paused: dict[str, set[str]] = {}
    for job_table_name, queue in session.execute(statement):
        paused.setdefault(job_table_name, set()).add(queue)
    return paused


def table_of(jobs: Any) -> Table:
    """The job table of a repository (sync or asyncio) or of a JobMixin model."""
    table = getattr(jobs, "table", None)
    if isinstance(table, Table):
        return table
    if isinstance(jobs, type):
        return job_table(jobs)  # type: ignore[no-any-return]
    raise InvalidArgumentError("jobs", f"must be a JobRepository or a JobMixin model, got {type(jobs).__name__}")
