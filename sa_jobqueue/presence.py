"""Worker presence: which worker processes are alive, and what each is running.

Every worker upserts a row of ``sa_jobqueue_workers`` when it starts and
again every ``heartbeat_interval`` (its *presence beat*), and deletes it when
it stops cleanly. A row whose ``expires_at`` (three beats after the last)
has passed is a worker that is gone: crashed, killed, or cut off from the
database. Gone rows are kept for :data:`GONE_KEPT` so an operator can see
what went away, then the beat of any live worker deletes them.

What a caller may rely on: :func:`list_workers` reads the rows as of its
statement, ``alive`` judged by the database's clock; a worker's ``running``
list is as of its last beat (at most one ``heartbeat_interval`` old). The
beat is not on a job's path: a worker whose beat fails (the table is not
created yet) logs it and runs its jobs as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Interval, bindparam, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .checks import check_session
from .control_tables import WORKERS

__all__ = ["GONE_KEPT", "WorkerPresence", "beat", "prune_gone", "list_workers", "withdraw"]

GONE_KEPT = timedelta(hours=1)
"""How long the row of a worker that is gone stays visible."""


@dataclass(frozen=True)
class WorkerPresence:
    """One worker process as its last beat described it."""

    id: str
    name: str
    host: str
    pid: int
    driver: str
    mode: str
    concurrency: int
    tables: list[str]
    queues: list[str]
    started_at: datetime
    beat_at: datetime
    expires_at: datetime
    running: list[dict[str, Any]]
    alive: bool


def beat(session: Any, row: dict[str, Any], *, expires_in: timedelta) -> None:
    """Insert or refresh the row of one worker (``row``: every column but the
    instants, which the database's clock sets)."""
    session = check_session(session)
    values = dict(row, beat_at=func.now(), expires_at=func.now() + bindparam("expires_in", type_=Interval()))
    statement = pg_insert(WORKERS).values(values)
    statement = statement.on_conflict_do_update(
        index_elements=[WORKERS.c.id],
        set_={"beat_at": statement.excluded.beat_at, "expires_at": statement.excluded.expires_at,
              "running": statement.excluded.running},
    )
    session.execute(statement, {"expires_in": expires_in})


def withdraw(session: Any, worker_id: str) -> None:
    """Delete the row of a worker that stops."""
    check_session(session).execute(delete(WORKERS).where(WORKERS.c.id == worker_id))


def prune_gone(session: Any, *, kept: timedelta = GONE_KEPT) -> int:
    """Delete the rows of workers gone for longer than ``kept``; return how many."""
    statement = delete(WORKERS).where(WORKERS.c.expires_at < func.now() - bindparam("kept", type_=Interval()))
    return int(check_session(session).execute(statement, {"kept": kept}).rowcount)


def list_workers(session: Any, *, tables: Sequence[str] | None = None) -> list[WorkerPresence]:
    """The workers' rows, alive first, then by name: of every worker, or of
    those serving any of ``tables`` (job table names)."""
    session = check_session(session)
    alive = (WORKERS.c.expires_at > func.now()).label("alive")
    statement = select(*WORKERS.c, alive).order_by(alive.desc(), WORKERS.c.name, WORKERS.c.started_at)
    if tables is not None:
        statement = statement.where(WORKERS.c.tables.overlap(list(tables)))
    return [WorkerPresence(**row._asdict()) for row in session.execute(statement)]
