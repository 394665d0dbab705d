"""Throughput: the jobs workers finished per minute, by job table and queue.

Each worker counts in memory the jobs whose outcome it committed (completed,
or an attempt that failed: retried, dead or timed out) per job table and
queue, and its presence beat adds the counts to the current minute's row of
``sa_jobqueue_throughput`` (revision 0007): one upsert per beat, none per
job. The dashboard's overview reads an hour of rows per table, which costs
the same on a table of a million jobs as on an empty one, and works as well
on tables that delete finished jobs as on those that keep them.

What a caller may rely on: a minute's counts are those the workers' beats
wrote during it, so a job is counted in the minute of the beat after its
outcome committed (at most one ``heartbeat_interval`` late); counts a
failing write could not add are kept by the worker and added by a later
beat; rows older than :data:`THROUGHPUT_KEPT` are deleted by the beats.
Jobs finished by other means (``JobRepository.complete`` in your own code,
the reaper, an action of the dashboard) are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Interval, bindparam, delete, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .checks import check_session
from .control_tables import THROUGHPUT

__all__ = ["THROUGHPUT_KEPT", "THROUGHPUT_MINUTES", "Minute", "add_finished", "per_minute", "per_minute_statement",
           "prune_throughput"]

THROUGHPUT_KEPT = timedelta(hours=2)
"""How long a minute's row is kept."""
THROUGHPUT_MINUTES = 60
"""The minutes :func:`per_minute` reads: the last hour, the current minute included."""


@dataclass(frozen=True)
class Minute:
    """The jobs finished in one minute: ``done`` (completed) and ``failed`` (attempts that failed)."""

    start: datetime
    done: int
    failed: int


def add_finished(session: Any, counts: Mapping[tuple[str, str], list[int]]) -> None:
    """Add ``counts`` ((job table, queue) -> [completed, failed]) to the current minute's rows."""
    if not counts:
        return
    session = check_session(session)
    # In key order: two workers adding the same rows lock them in the same order.
    rows = [{"job_table": t, "queue": q, "minute": func.date_trunc("minute", func.now()), "completed": c, "failed": f}
            for (t, q), (c, f) in sorted(counts.items())]
    statement = pg_insert(THROUGHPUT).values(rows)
    statement = statement.on_conflict_do_update(
        index_elements=[THROUGHPUT.c.job_table, THROUGHPUT.c.queue, THROUGHPUT.c.minute],
        set_={"completed": THROUGHPUT.c.completed + statement.excluded.completed,
              "failed": THROUGHPUT.c.failed + statement.excluded.failed},
    )
    session.execute(statement)


def prune_throughput(session: Any, *, kept: timedelta = THROUGHPUT_KEPT) -> int:
    """Delete the rows of minutes older than ``kept``; return how many."""
    statement = delete(THROUGHPUT).where(THROUGHPUT.c.minute < func.now() - bindparam("kept", type_=Interval()))
    return int(check_session(session).execute(statement, {"kept": kept}).rowcount)


def per_minute(session: Any, table: str, *, minutes: int = THROUGHPUT_MINUTES) -> list[Minute]:
    """The last ``minutes`` minutes of ``table`` (a job table's name), oldest first, every minute
    included (zero when nothing finished), the current one so far."""
    rows = check_session(session).execute(per_minute_statement(table, minutes))
    return [Minute(start, int(done), int(failed)) for start, done, failed in rows]


def per_minute_statement(table: str, minutes: int = THROUGHPUT_MINUTES) -> Any:
    """The statement of :func:`per_minute`: ``(start, done, failed)`` rows, one an hour's minute."""
    now = func.date_trunc("minute", func.now())
    series = select(func.generate_series(now - text(f"interval '{int(minutes) - 1} minutes'"), now,
                                         text("interval '1 minute'")).label("start")).subquery("series")
    counted = (
        select(THROUGHPUT.c.minute, func.sum(THROUGHPUT.c.completed).label("done"),
               func.sum(THROUGHPUT.c.failed).label("failed"))
        .where(THROUGHPUT.c.job_table == table, THROUGHPUT.c.minute > now - text(f"interval '{int(minutes)} minutes'"))
        .group_by(THROUGHPUT.c.minute)
        .subquery("counted")
    )
    return (
        select(series.c.start, func.coalesce(counted.c.done, 0), func.coalesce(counted.c.failed, 0))
        .select_from(series.outerjoin(counted, counted.c.minute == series.c.start))
        .order_by(series.c.start)
    )
