"""JobMixin: turn a declarative model into a job table.

Add the mixin to your own model and give it a table name::

    class EmailJob(JobMixin, Base):
        __tablename__ = "email_jobs"
        tenant_id: Mapped[int | None]       # your own columns sit alongside

Each model gets its own table with the job columns, a named CHECK on the
status, and four indexes whose names derive from the table name, so any
number of job tables live side by side on one or several ``Base`` classes:

* ``ix_<table>_claim_v2``: partial index ``(queue, priority, run_at, id)
  WHERE status = 'pending'``; the claim reads each queue, and within it each
  priority, as one range of it in claim order, so it reads only the rows it
  locks whatever other queues or future jobs hold (``_v1`` lacked ``queue``);
* ``ix_<table>_lease_v1``: partial index ``(lease_expires_at) WHERE status =
  'running'`` for the reaper;
* ``uq_<table>_dedupe_v1``: partial unique index ``(queue, dedupe_key)`` over
  live jobs (pending or running), used by ``INSERT … ON CONFLICT``;
* ``ix_<table>_dedupe_done_v1``: partial index ``(queue, dedupe_key,
  created_at) WHERE dedupe_key IS NOT NULL AND status = 'done'``, where a
  dedupe window finds the finished jobs of its key (empty on a table that
  deletes finished jobs);
* ``ix_<table>_status_v1``: partial index ``(status, queue, id) WHERE
  status IN ('pending', 'done', 'dead', 'cancelled')``, where the dashboard
  lists the jobs of a status (and queue) newest first and counts them up
  to a limit; it leaves the running jobs out (they are few, and the lease
  index has them), so a claim writes no entry in it.

Names carry a version because Alembic's autogenerate cannot compare a partial
index predicate: a changed predicate ships under a new name.

To add table arguments of your own, keep the job ones::

    @declared_attr.directive
    def __table_args__(cls):
        return (*job_table_args(cls.__tablename__), Index("ix_email_tenant", "tenant_id"))

Set ``__keep_done__ = True`` on the model to keep completed jobs as ``done``
(with ``finished_at``) instead of deleting them.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Identity,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    Uuid,
    func,
    text,
)
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import NoInspectionAvailable
from sqlalchemy.orm import Mapped, declared_attr, mapped_column
from sqlalchemy.sql.naming import conv

from .errors import JobTableError
from .states import (
    CANCELLED,
    CLAIM_PREDICATE,
    COLUMN_DEFAULTS,
    DEAD,
    DEDUPE_DONE_PREDICATE,
    DEDUPE_KEY_LENGTH,
    DEDUPE_PREDICATE,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    DONE,
    LEASE_PREDICATE,
    LIVE_STATUSES,
    NAME_LENGTH,
    NOW_DEFAULTS,
    PENDING,
    PRIORITY_MAX,
    PRIORITY_MIN,
    RUNNING,
    STATUS_INDEX_PREDICATE,
    STATUSES,
    server_default,
    sql_list,
)


def claim_index_name(table_name: str) -> str:
    return f"ix_{table_name}_claim_v2"


def claim_index_v1_name(table_name: str) -> str:
    """The claim index before ``_v2``: ``(priority, run_at, id)``,
    without ``queue``; :func:`sa_jobqueue.migrations.upgrade_claim_index` replaces it."""
    return f"ix_{table_name}_claim_v1"


CLAIM_INDEX_COLUMNS = ("queue", "priority", "run_at", "id")
DEDUPE_DONE_INDEX_COLUMNS = ("queue", "dedupe_key", "created_at")
STATUS_INDEX_COLUMNS = ("status", "queue", "id")


def lease_index_name(table_name: str) -> str:
    return f"ix_{table_name}_lease_v1"


def dedupe_index_name(table_name: str) -> str:
    return f"uq_{table_name}_dedupe_v1"


def dedupe_done_index_name(table_name: str) -> str:
    return f"ix_{table_name}_dedupe_done_v1"


def status_index_name(table_name: str) -> str:
    return f"ix_{table_name}_status_v1"


def status_check_name(table_name: str) -> str:
    return f"ck_{table_name}_status_v1"


def max_attempts_check_name(table_name: str) -> str:
    return f"ck_{table_name}_max_attempts_v1"


# PostgreSQL truncates longer identifiers silently, so two derived names
# could collide; the longest derived name must fit.
MAX_IDENTIFIER_BYTES = 63
MAX_TABLE_NAME_BYTES = MAX_IDENTIFIER_BYTES - len(max_attempts_check_name("").encode())


def job_table_args(table_name: str) -> tuple[Any, ...]:
    """The indexes and checks every job table needs, named after ``table_name``.

    ``conv()`` marks each name as final, so a naming convention on the user's
    MetaData does not rename them. Raises :class:`JobTableError` when the
    table name is too long for the names derived from it to fit PostgreSQL's
    63-byte identifiers.
    """
    if len(table_name.encode()) > MAX_TABLE_NAME_BYTES:
        raise JobTableError(
            f"__tablename__: {table_name!r} is too long for a job table; names derived from it "
            f"(such as {max_attempts_check_name(table_name)!r}) must fit PostgreSQL's "
            f"{MAX_IDENTIFIER_BYTES} bytes, so keep it to {MAX_TABLE_NAME_BYTES} bytes"
        )
    return (
        CheckConstraint(f"status IN ({sql_list(STATUSES)})", name=conv(status_check_name(table_name))),
        CheckConstraint("max_attempts >= 1", name=conv(max_attempts_check_name(table_name))),
        Index(
            conv(claim_index_name(table_name)),
            *CLAIM_INDEX_COLUMNS,
            postgresql_where=text(CLAIM_PREDICATE),
        ),
        Index(
            conv(lease_index_name(table_name)),
            "lease_expires_at",
            postgresql_where=text(LEASE_PREDICATE),
        ),
        Index(
            conv(dedupe_index_name(table_name)),
            "queue",
            "dedupe_key",
            unique=True,
            postgresql_where=text(DEDUPE_PREDICATE),
        ),
        Index(
            conv(dedupe_done_index_name(table_name)),
            *DEDUPE_DONE_INDEX_COLUMNS,
            postgresql_where=text(DEDUPE_DONE_PREDICATE),
        ),
        Index(
            conv(status_index_name(table_name)),
            *STATUS_INDEX_COLUMNS,
            postgresql_where=text(STATUS_INDEX_PREDICATE),
        ),
    )


class JobMixin:
    """Columns, indexes and checks of a job table; no behaviour, no I/O.

    The queue verbs live in :class:`~sa_jobqueue.JobRepository`.
    """

    __keep_done__: ClassVar[bool] = False

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    queue: Mapped[str] = mapped_column(String(NAME_LENGTH), server_default=server_default("queue"))
    task: Mapped[str] = mapped_column(String(NAME_LENGTH))
    payload: Mapped[Any] = mapped_column(
        JSON().with_variant(JSONB(), "postgresql"), server_default=server_default("payload")
    )
    status: Mapped[str] = mapped_column(String(16), server_default=server_default("status"))
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=server_default("priority"))
    run_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    attempts: Mapped[int] = mapped_column(Integer, server_default=server_default("attempts"))
    # The limit given at enqueue; NULL when none was: then the task's own
    # max_attempts applies, else DEFAULT_MAX_ATTEMPTS (statements.attempts_limit).
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    locked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    locked_by: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    lock_token: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    last_error: Mapped[str | None] = mapped_column(Text)
    dedupe_key: Mapped[str | None] = mapped_column(String(DEDUPE_KEY_LENGTH))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # When a cancel of the job was asked for while it ran (JobRepository.cancel);
    # the worker running it stops it, or its next exit from running other than
    # a completion (fail, hand_back, reap) ends it cancelled. Last, so that a
    # table migrated by ADD COLUMN has the columns of a fresh create_all.
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # What the handler returned (sa_jobqueue.results), on tables that keep
    # finished jobs; NULL otherwise. Last, for the reason above.
    result: Mapped[Any | None] = mapped_column(JSON().with_variant(JSONB(), "postgresql"))
    # What travels with a job besides its payload, written at enqueue (a JSON
    # object or NULL): the trace context of the enqueuing code, for one.
    meta: Mapped[Any | None] = mapped_column(JSON().with_variant(JSONB(), "postgresql"))
    # How long the job holds its dedupe key (sa_jobqueue.dedupe): NULL while it
    # is live (pending or running), 'started' while it is pending only (the
    # claim clears dedupe_key then). Last, for the reason above.
    dedupe_until: Mapped[str | None] = mapped_column(String(16))
    # How far the running attempt is, as its handler last reported it
    # (sa_jobqueue.progress): written by the heartbeat, cleared by the claim.
    # Last, for the reason above.
    progress: Mapped[Any | None] = mapped_column(JSON().with_variant(JSONB(), "postgresql"))

    @declared_attr.directive
    def __table_args__(cls) -> tuple[Any, ...]:
        return job_table_args(cls.__tablename__)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} id={self.id!r} queue={self.queue!r} "
            f"task={self.task!r} status={self.status!r} attempts={self.attempts!r}>"
        )


def job_table(model: Any) -> Any:
    """The table of a mapped JobMixin model, checked: raise :class:`JobTableError`
    unless ``model`` is one and its table still has the claim, lease and dedupe
    indexes (a ``__table_args__`` of its own may have replaced them)."""
    if not isinstance(model, type) or not issubclass(model, JobMixin):
        raise JobTableError(
            f"model: {model!r} is not a JobMixin model; declare "
            "`class MyJob(JobMixin, Base): __tablename__ = ...` and pass the class"
        )
    try:
        table = sa_inspect(model).local_table
    except NoInspectionAvailable:
        raise JobTableError(
            f"model: {model.__name__} uses JobMixin but is not mapped; "
            "it needs a declarative Base and a __tablename__"
        ) from None
    names = {index.name for index in table.indexes}
    wanted = [claim_index_name(table.name), lease_index_name(table.name), dedupe_index_name(table.name)]
    missing = [name for name in wanted if name not in names]
    if missing:
        raise JobTableError(
            f"model: {model.__name__} (table {table.name!r}) lacks the job indexes "
            f"{missing}; its __table_args__ replaced JobMixin's. Keep them with "
            "`@declared_attr.directive def __table_args__(cls): "
            "return (*job_table_args(cls.__tablename__), ...)`"
        )
    return table


# The states' names, defaults and limits were first defined here: importing
# them from this module keeps working.
__all__ = [
    "CANCELLED",
    "CLAIM_INDEX_COLUMNS",
    "DEDUPE_DONE_INDEX_COLUMNS",
    "DEDUPE_DONE_PREDICATE",
    "CLAIM_PREDICATE",
    "COLUMN_DEFAULTS",
    "DEAD",
    "DEDUPE_KEY_LENGTH",
    "DEDUPE_PREDICATE",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_QUEUE",
    "DONE",
    "JobMixin",
    "LEASE_PREDICATE",
    "LIVE_STATUSES",
    "MAX_IDENTIFIER_BYTES",
    "MAX_TABLE_NAME_BYTES",
    "NAME_LENGTH",
    "NOW_DEFAULTS",
    "PENDING",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "RUNNING",
    "STATUSES",
    "STATUS_INDEX_COLUMNS",
    "claim_index_name",
    "claim_index_v1_name",
    "dedupe_done_index_name",
    "dedupe_index_name",
    "job_table",
    "job_table_args",
    "lease_index_name",
    "max_attempts_check_name",
    "server_default",
    "status_check_name",
    "status_index_name",
]
