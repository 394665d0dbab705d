"""Statements in flight on a watched connection, as the thread that owns it
sees them (see :mod:`sa_jobqueue.watchdog`, which judges them).

A watched psycopg connection makes its cursors with a subclass of its own
cursor class whose ``execute`` and ``executemany`` mark the statement in
flight until they return or raise; :meth:`ConnectionWatch.in_flight` marks
a command sent without a cursor (``COMMIT``). Nothing here starts a thread
or sends anything.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

__all__ = ["NOT_WATCHED", "ConnectionWatch", "StatementRecord", "watched_cursors"]


@dataclass(eq=False)
class StatementRecord:
    """What a watchdog knows of one watched connection. ``pid`` and ``fd``
    are read once, by the thread that owns the connection; the rest changes
    under ``lock`` (the watchdog's): the thread that executes marks a
    statement started and ended, the watchdog's thread reads and judges."""

    pid: int
    fd: int
    lock: threading.Lock = field(repr=False)
    since: float | None = None  # monotonic start of the statement in flight, None when none is
    statement: int = 0  # counts the connection's statements: which one a check judged
    idle_checks: int = 0  # checks in a row that found the backend idle during this statement
    # The watched cursor classes of the connection, by the cursor class each extends.
    classes: dict[type[Any], type[psycopg.Cursor[Any]]] = field(default_factory=dict, repr=False)

    def cursors(self, base: Any) -> type[psycopg.Cursor[Any]] | None:
        """The watched cursor class over ``base``, the connection's own cursor
        class (``psycopg.Cursor``, or an application's ``ClientCursor``, which
        stays what it is); made once per class. None when ``base`` is not a
        psycopg cursor class (a factory function): such a connection is not
        watched."""
        if not (isinstance(base, type) and issubclass(base, psycopg.Cursor)):
            return None
        made = self.classes.get(base)
        if made is None:
            made = self.classes[base] = watched_cursors(self, base)
        return made

    def started(self) -> None:
        with self.lock:
            self.since = time.monotonic()
            self.statement += 1
            self.idle_checks = 0

    def ended(self) -> None:
        with self.lock:
            self.since = None


def watched_cursors(backend: StatementRecord, base: type[psycopg.Cursor[Any]]) -> type[psycopg.Cursor[Any]]:
    """A subclass of the cursor class ``base`` whose statements ``backend``
    sees: each in flight from the call until it returns or raises. Made once
    per connection and class, so that making a cursor costs what making a
    ``base`` does."""

    class WatchedCursor(base):  # type: ignore[valid-type,misc]
        __slots__ = ()

        def execute(self, *args: Any, **kwargs: Any) -> Any:
            backend.started()
            try:
                return super().execute(*args, **kwargs)
            finally:
                backend.ended()

        def executemany(self, *args: Any, **kwargs: Any) -> Any:
            backend.started()
            try:
                return super().executemany(*args, **kwargs)
            finally:
                backend.ended()

    return WatchedCursor


class ConnectionWatch:
    """A job's hold on a watched connection (see :meth:`Watchdog.watch_jobs`),
    used by the thread that holds the connection."""

    def __init__(self, backend: StatementRecord | None, dbapi_connection: Any = None, previous: Any = None) -> None:
        self._backend = backend
        self._dbapi_connection = dbapi_connection
        self._previous = previous

    def in_flight(self) -> ConnectionWatch:
        """Watch a command sent without a cursor, ``COMMIT`` above all
        (psycopg sends it from the connection): ``with watch.in_flight():``,
        in flight for the watchdog until the block returns or raises."""
        return self

    # A class-based context manager: this runs once per job, and a generator
    # (contextlib) costs several calls more.
    def __enter__(self) -> None:
        if self._backend is not None:
            self._backend.started()

    def __exit__(self, *exc_info: object) -> None:
        if self._backend is not None:
            self._backend.ended()

    def release(self) -> None:
        """Stop watching: the connection's own cursor class again. Call it
        before the connection goes back to the pool."""
        if self._backend is not None:
            self._dbapi_connection.cursor_factory = self._previous
            self._backend.ended()


#: The watch of a connection that is not watched (no watchdog, or not a psycopg connection).
NOT_WATCHED = ConnectionWatch(None)
