"""What the dashboard's pages read: plain SQLAlchemy over a job table, one function a page.

Every function takes a :class:`~sqlalchemy.orm.Session` whose transaction the
caller owns (the web layers open a read-only one per request) and a
:class:`~sa_jobqueue.JobRepository`; none writes, and none takes a lock a
worker could wait on (plain ``SELECT``s take only ``ACCESS SHARE``). The jobs
list pages by keyset (``id < before``, newest first), never ``OFFSET``; a
filter on status (and queue) reads ``ix_<t>_status_v1`` in that order. The
overview's counts and throughput are :mod:`sa_jobqueue.dashboard.counts`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, Table, and_, bindparam, cast, func, literal_column, select, true
from sqlalchemy.dialects.postgresql import JSONPATH
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ..mixin import JobMixin
from ..repository import JobRepository
from ..states import PENDING
from .filters import PAGE_SIZE, SCHEDULED, FilterError, JobFilter


def user_columns(repository: JobRepository[Any]) -> frozenset[str]:
    """The columns of the repository's table that are the application's own (not the mixin's)."""
    job_columns = {name for name in JobMixin.__annotations__ if not name.startswith("__")}
    return frozenset(c.key for c in repository.table.columns if c.key not in job_columns)


@dataclass(frozen=True)
class Page:
    """One page of the jobs list: the jobs, newest first, and the id to ask for the next
    page with (``before``), None on the last page."""

    jobs: list[Any]
    next_before: int | None


def jobs_page(session: Session, repository: JobRepository[Any], wanted: JobFilter,
              limit: int = PAGE_SIZE) -> Page:
    """The jobs matching ``wanted``, newest first, at most ``limit``, after its keyset.

    A ``payload_path`` PostgreSQL cannot parse raises :class:`FilterError`
    (it is parsed first, in a statement of its own).
    """
    t: Table = repository.table
    if wanted.payload_path is not None:
        check_path(session, wanted.payload_path)
    stmt = select(*repository.snapshots.columns).order_by(t.c.id.desc()).limit(limit + 1)
    for condition in conditions(t, wanted):
        stmt = stmt.where(condition)
    jobs = repository.snapshots.all(session.execute(stmt).all())
    if len(jobs) > limit:
        return Page(jobs[:limit], jobs[limit - 1].id)
    return Page(jobs, None)


def check_path(session: Session, path: str) -> None:
    """Raise :class:`FilterError` (``payload``) unless PostgreSQL parses ``path`` as a SQL/JSON path.

    Parsed in a SAVEPOINT, so a bad path leaves the caller's transaction usable."""
    try:
        with session.begin_nested():
            session.execute(select(cast(bindparam("path", path, type_=String()), JSONPATH)))
    except DBAPIError as exc:
        diag = getattr(exc.orig, "diag", None)
        message = getattr(diag, "message_primary", None) or str(exc.orig)
        raise FilterError("payload", f"not a SQL/JSON path: {message}") from None


def conditions(t: Table, wanted: JobFilter) -> list[Any]:
    """The WHERE conditions of ``wanted`` on table ``t`` (its keyset included)."""
    conditions: list[Any] = []
    if wanted.status == SCHEDULED:
        conditions.append(and_(t.c.status == literal_column(f"'{PENDING}'"), t.c.run_at > func.now()))
    elif wanted.status is not None:
        # A literal, as in the partial indexes' predicates, so that they stay usable.
        conditions.append(t.c.status == literal_column("'" + wanted.status + "'"))
    for column, value in (("queue", wanted.queue), ("task", wanted.task), ("id", wanted.job_id)):
        if value is not None:
            conditions.append(t.c[column] == value)
    if wanted.payload_path is not None:
        # A predicate ($.user_id == 42, exists($.retry)); silent: a path whose result is not a
        # boolean, or a field a payload lacks, matches nothing instead of failing the page.
        path = cast(bindparam("payload_path", wanted.payload_path, type_=String()), JSONPATH)
        conditions.append(func.jsonb_path_match(t.c.payload, path, literal_column("'{}'::jsonb"), true()))
    for name, value in wanted.columns.items():
        conditions.append(cast(t.c[name], String()) == value)
    if wanted.before is not None:
        conditions.append(t.c.id < wanted.before)
    return conditions


def matching_ids(session: Session, repository: JobRepository[Any], wanted: JobFilter, limit: int) -> list[int]:
    """The ids of up to ``limit`` jobs matching ``wanted`` (its keyset included), newest first."""
    t: Table = repository.table
    if wanted.payload_path is not None:
        check_path(session, wanted.payload_path)
    stmt = select(t.c.id).order_by(t.c.id.desc()).limit(limit)
    for condition in conditions(t, wanted):
        stmt = stmt.where(condition)
    return list(session.scalars(stmt))


def job_detail(session: Session, repository: JobRepository[Any], job_id: int) -> Any | None:
    """The job ``job_id`` of the table (a detached snapshot), or None."""
    t: Table = repository.table
    row = session.execute(select(*repository.snapshots.columns).where(t.c.id == job_id)).first()
    return None if row is None else repository.snapshots.one(row)


__all__ = [
    "Page", "check_path", "conditions", "job_detail", "jobs_page", "matching_ids", "user_columns",
]
