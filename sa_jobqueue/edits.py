"""Edits of jobs no worker holds: run a pending job now, change its priority, delete a job.

What an operator does by hand (the dashboard's actions, beside
:meth:`~sa_jobqueue.JobRepository.retry` and
:meth:`~sa_jobqueue.JobRepository.cancel`). Each is one statement on the
caller's session, never commits, and returns whether it changed the job. None
touches a ``running`` job: its worker owns it (and its fence), so a running
job is left as it is and the edit returns False. A claim that takes the job
at the same instant wins or waits: the edit's ``UPDATE`` or ``DELETE``
re-reads the row after the claim commits and then finds it running.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, bindparam, delete, func, literal_column, update
from sqlalchemy.orm import Session

from .checks import check_job_id, check_session, int_between
from .repository import JobRepository
from .states import PENDING, PRIORITY_MAX, PRIORITY_MIN, RUNNING

_NO_SYNC = {"synchronize_session": False}


def _pending(t: Table) -> Any:
    return (t.c.id == bindparam("job_id")) & (t.c.status == literal_column(f"'{PENDING}'"))


def run_now(session: Session, repository: JobRepository[Any], job_id: int) -> bool:
    """Make a pending job runnable now (its ``run_at`` now, on the database's clock)."""
    session = check_session(session)
    t: Table = repository.table
    stmt = update(t).where(_pending(t)).values(run_at=func.now()).returning(t.c.id)
    return session.execute(stmt, {"job_id": check_job_id(job_id)}, execution_options=_NO_SYNC).first() is not None


def set_priority(session: Session, repository: JobRepository[Any], job_id: int, priority: int) -> bool:
    """Give a pending job ``priority`` (-32768 … 32767, lower runs first)."""
    session = check_session(session)
    t: Table = repository.table
    params = {"job_id": check_job_id(job_id), "new_priority": int_between("priority", priority, PRIORITY_MIN,
                                                                          PRIORITY_MAX)}
    stmt = update(t).where(_pending(t)).values(priority=bindparam("new_priority")).returning(t.c.id)
    return session.execute(stmt, params, execution_options=_NO_SYNC).first() is not None


def delete_job(session: Session, repository: JobRepository[Any], job_id: int) -> bool:
    """Delete a job that is not running (pending, or finished in any way)."""
    session = check_session(session)
    t: Table = repository.table
    stmt = delete(t).where(t.c.id == bindparam("job_id"), t.c.status != literal_column(f"'{RUNNING}'"))
    return session.execute(stmt.returning(t.c.id), {"job_id": check_job_id(job_id)},
                           execution_options=_NO_SYNC).first() is not None


__all__ = ["delete_job", "run_now", "set_priority"]
