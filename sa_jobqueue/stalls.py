"""When a statement in flight is stalled: the judgment both watchdogs share.

The thread worker's :class:`~sa_jobqueue.watchdog.Watchdog` and the asyncio
worker's :class:`~sa_jobqueue.aio.watchdog.AsyncWatchdog` watch statements
differently (cursor classes and a thread; SQLAlchemy events and a task) and
free a stalled one differently, but decide alike, here: a statement in
flight for ``after`` seconds is a suspect; it is stalled when its backend
is neither ``active`` nor unknown to the server (a pooler's id) and has not
changed state for ``after`` seconds either, seen so in two checks in a row
of the same statement (the reply may have been on its way at the first).

Pure decisions on plain records: no clock is read, nothing is sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

__all__ = ["InFlight", "is_stalled", "suspects"]

#: Checks in a row that must find the backend idle before a statement is judged stalled.
CONFIRMATIONS = 2


class InFlight(Protocol):
    """What a watchdog records of one watched connection."""

    since: float | None  # monotonic start of the statement in flight; None when none is
    statement: int  # counts the connection's statements: which one a check judged
    idle_checks: int  # checks in a row that found the backend idle during this statement


R = TypeVar("R", bound=InFlight)


def suspects(records: Iterable[R], *, now: float, after: float) -> list[tuple[R, int, float]]:
    """The statements in flight for ``after`` seconds as of ``now``: (record, which statement, since)."""
    found = []
    for record in records:
        since, statement = record.since, record.statement
        if since is not None and now - since >= after:
            found.append((record, statement, since))
    return found


def is_stalled(record: InFlight, statement: int, *, state: str, age: float, after: float) -> bool:
    """Judge the suspect ``statement`` of ``record`` given its backend's
    ``state`` in ``pg_stat_activity`` ("unknown" when the server does not
    list it) and ``age``, the seconds since that state began; count the
    check on ``record``. True when it is stalled. A statement that ended
    meanwhile, or was followed by another, is never stalled. Call it where
    nothing else changes the record meanwhile (under its lock, or in the
    event loop that owns it)."""
    if record.statement != statement or record.since is None:
        return False  # it ended meanwhile
    if state in ("unknown", "active") or age < after:
        # Unknown to this server, running, or busy with other statements lately: leave it.
        record.idle_checks = 0
        return False
    record.idle_checks += 1
    return record.idle_checks >= CONFIRMATIONS
