"""The periodic schedules page's query: each schedule's last tick, and its next one.

Reads ``sa_jobqueue_periodic`` (:mod:`sa_jobqueue.periodic`), where the
workers record, per schedule, the last tick they enqueued; the next tick is
computed from its cron expression. A database without the table (no
schedule ever ran) has no schedules. Reads only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from ..periodic import PERIODIC, PERIODIC_TABLE
from ..schedule import next_tick


@dataclass(frozen=True)
class Schedule:
    """One schedule: its job table, queue and name (the parts of the row's name), cron, and ticks."""

    table: str
    queue: str
    name: str
    cron: str
    last_tick: datetime
    next_tick: datetime | None  # None when the stored cron cannot be read any more


def schedules(session: Session, tables: Sequence[str]) -> list[Schedule]:
    """The schedules of the job ``tables``, by table, queue and name."""
    exists = session.execute(text("SELECT to_regclass(:name) IS NOT NULL"), {"name": PERIODIC_TABLE}).scalar()
    if not exists:
        return []
    found: list[Schedule] = []
    for name, last_tick, cron in session.execute(select(PERIODIC.c.name, PERIODIC.c.last_tick, PERIODIC.c.cron)
                                                 .order_by(PERIODIC.c.name)):
        table, _, rest = name.partition("/")
        queue, _, schedule = rest.partition("/")
        if table not in tables:
            continue
        try:
            upcoming: datetime | None = next_tick(cron, last_tick)
        except (ValueError, KeyError):  # a cron written by an older version, or by hand
            upcoming = None
        found.append(Schedule(table, queue, schedule, cron, last_tick, upcoming))
    return found


__all__ = ["Schedule", "schedules"]
