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

__all__ = [
    "NOT_WATCHABLE", "NOT_WATCHED", "ConnectionWatch", "StatementRecord", "unwatch_cursors", "watch_cursors",
    "watched_cursors",
]


@dataclass(eq=False)
class StatementRecord:
    """What a watchdog knows of one watched connection. ``pid`` and ``fd``
    are read once, by the thread that owns the connection; the rest changes
    as the thread that executes marks a statement started and ended (the end
    under ``lock``), while the watchdog's thread reads and judges under it.
    One lock per connection, not one per watchdog: the jobs' threads mark
    every statement, and a lock they all shared would make them wait on
    each other."""

    pid: int
    fd: int
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    since: float | None = None  # monotonic start of the statement in flight, None when none is
    statement: int = 0  # counts the connection's statements: which one a check judged
    idle_checks: int = 0  # checks in a row that found the backend idle during this statement

    def started(self) -> None:
        # Without the lock: it runs for every statement, and the only thread
        # that writes these fields is the one that owns the connection. A
        # watchdog that judged the previous statement and acts as this one
        # starts finds its socket still this connection's (it is in use), and
        # its backend was terminated anyway. Statement first: a check that
        # pairs a new start with the old count gives up on it (it compares
        # the count again under the lock).
        self.statement += 1
        self.idle_checks = 0
        self.since = time.monotonic()

    def ended(self) -> None:
        # Under the lock: once this returns the watchdog cannot shut the
        # socket down, so the owner may close the connection (and the
        # descriptor be reused) safely.
        with self.lock:
            self.since = None


# The attribute of a watched psycopg connection naming its record, read by
# the watched cursors: None (or absent) when the connection is not watched.
_RECORD = "_sa_jobqueue_statements"

# The watched cursor classes, one per cursor class they extend, for the whole
# process. A class per connection would do without the attribute, but every
# call site in psycopg and SQLAlchemy that touches a cursor would then see
# many types, which CPython's specializing interpreter runs on its slower
# path: a transaction-mode drain at 16 threads ran about 10% slower so.
_classes: dict[type[Any], type[psycopg.Cursor[Any]]] = {}
_classes_lock = threading.Lock()


#: What :func:`watch_cursors` returns for a connection it cannot watch.
NOT_WATCHABLE = object()


def watched_cursors(base: Any) -> type[psycopg.Cursor[Any]] | None:
    """The watched cursor class over ``base``, a connection's own cursor
    class (``psycopg.Cursor``, or an application's ``ClientCursor``, which
    stays what it is): each statement of a cursor it makes is in flight for
    the record of the cursor's connection (:func:`watch_cursors`) from the
    call until it returns or raises. None when ``base`` is not a psycopg
    cursor class (a factory function): such a connection is not watched."""
    if not (isinstance(base, type) and issubclass(base, psycopg.Cursor)):
        return None
    if base in _classes.values():
        return base  # watched already
    made = _classes.get(base)
    if made is None:
        with _classes_lock:
            made = _classes.get(base)
            if made is None:
                made = _classes[base] = _watched_subclass(base)
    return made


def watch_cursors(dbapi_connection: Any, record: StatementRecord) -> Any:
    """Make the statements of ``dbapi_connection``'s cursors in flight for
    ``record`` from now on; return the cursor class it had, to give back to
    :func:`unwatch_cursors`. Returns :data:`NOT_WATCHABLE`, and changes
    nothing, when its cursor factory is not a psycopg cursor class. Call it
    in the thread that owns the connection."""
    previous = getattr(dbapi_connection, "cursor_factory", None)
    cursors = watched_cursors(previous)
    if cursors is None:
        return NOT_WATCHABLE
    setattr(dbapi_connection, _RECORD, record)
    dbapi_connection.cursor_factory = cursors
    return previous


def unwatch_cursors(dbapi_connection: Any, previous: Any) -> None:
    """Undo :func:`watch_cursors`: the connection's own cursor class again."""
    dbapi_connection.cursor_factory = previous
    setattr(dbapi_connection, _RECORD, None)


def _in_flight(cursor: Any, send: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``send`` (a cursor's own execute) in flight for the record of the
    cursor's connection; as it is when the connection is no longer watched
    (a cursor made while it was, used after)."""
    record: StatementRecord | None = getattr(cursor.connection, _RECORD, None)
    if record is None:
        return send(*args, **kwargs)
    record.started()
    try:
        return send(*args, **kwargs)
    finally:
        record.ended()


def _watched_subclass(base: type[psycopg.Cursor[Any]]) -> type[psycopg.Cursor[Any]]:
    class WatchedCursor(base):  # type: ignore[valid-type,misc]
        __slots__ = ()

        def execute(self, *args: Any, **kwargs: Any) -> Any:
            return _in_flight(self, super().execute, args, kwargs)

        def executemany(self, *args: Any, **kwargs: Any) -> Any:
            return _in_flight(self, super().executemany, args, kwargs)

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
            unwatch_cursors(self._dbapi_connection, self._previous)
            self._backend.ended()


#: The watch of a connection that is not watched (no watchdog, or not a psycopg connection).
NOT_WATCHED = ConnectionWatch(None)
