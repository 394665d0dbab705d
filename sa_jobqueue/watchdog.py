"""Watchdog: frees connections stalled behind a half-open network path.

A connection can stall with a statement in flight: a proxy, pooler or NAT
in between stops forwarding while still acknowledging TCP, so keepalives and
``tcp_user_timeout`` never fire, and ``statement_timeout`` never starts
because the statement never reached the server. The calling thread then
waits forever: a job slot, a claim, or the worker's whole loop.

What is watched: the statements sent through the engines given to
:meth:`Watchdog.watch_engine`, which for a worker is its own engine
(:func:`sa_jobqueue.connections.worker_engine`: claims, heartbeats, reaps,
completions), and, through :meth:`Watchdog.watch_jobs`, those of the
connections the worker's jobs hold on the application's engine, while they
hold them. Nothing else: never the application's other connections.
Only statements sent through a cursor are watched, and the commands a job's
thread marks with :meth:`ConnectionWatch.in_flight` (the worker marks the
``COMMIT`` of a job's, or a batch's, transaction); not ``ROLLBACK``, nor
``COPY``, nor the pool's pings.

How a connection is watched without touching what another thread owns: a
watched psycopg connection makes its cursors with a cursor class of the
watchdog's (psycopg's ``Connection.cursor_factory``; one class per cursor
class it extends, see :mod:`sa_jobqueue.inflight`), whose ``execute`` and
``executemany`` record when a statement started and clear that when it
returns or raises, in the thread that executes. The backend pid and socket
are read once, by the thread that owns the connection. The watchdog's
thread only reads these records, under each connection's lock; it never
calls into libpq on a connection it does not own. No SQLAlchemy event is registered per
statement: a ``before_cursor_execute`` listener would put every statement of
the engine (the application's included) on SQLAlchemy's slower path with
events, for a cost a drain of short jobs measures.

A long statement and a stalled one look alike from the client (a statement
in flight, no reply yet), so the watchdog asks the server. Every
``interval`` it looks at the statements in flight; one in flight for
``after`` seconds is a suspect, and the watchdog reads the state of its
backend in ``pg_stat_activity`` over a connection of its own. A backend that
is not ``active`` and has not changed state for ``after`` seconds either
(its server side sat idle all along: the statement never arrived, or its
reply never came back), seen so in two checks in a row of the same
statement, is a stall. The watchdog terminates that backend (which gives
back its row locks at once) and shuts the client's socket down, so the
waiting call fails as a disconnect and the caller's usual error paths take
over (a claim is retried, a job's attempt fails and is retried).

What a caller may rely on: a statement that is running on the server is
never interrupted, however long it takes; a backend the watchdog cannot see
(behind PgBouncer, whose backend ids are its own) is never acted upon; a
socket is shut down only while the statement judged stalled is still in
flight, so never after its connection was closed (when its descriptor may
belong to something else).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import event
from sqlalchemy.engine import Engine

from .connections import own_session
from .inflight import NOT_WATCHABLE, NOT_WATCHED, ConnectionWatch, StatementRecord, watch_cursors
from .sockets import shutdown_socket, socket_deadline
from .stalls import is_stalled, suspects

log = logging.getLogger("sa_jobqueue.worker")

#: The ``application_name`` of the watchdog's own sessions, unless told otherwise.
WATCHDOG_APPLICATION_NAME = "sa_jobqueue watchdog"

# The backend's state, and for how long it has been in it (server clock).
_STATES = (
    "SELECT pid, state, extract(epoch FROM now() - state_change) "
    "FROM pg_stat_activity WHERE pid = ANY(%s)"
)


_UNWATCHED = object()  # the record of a connection that is not a psycopg one


class _Attempt:
    """A connection attempt in a thread of its own, so that a connect that
    hangs (no ``connect_timeout``, a stalled path) never holds up the
    watchdog; a connection that arrives after it was given up on is closed."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        self._conn: psycopg.Connection[Any] | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="sa_jobqueue-watchdog-connect", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        error: BaseException | None = None
        try:
            conn = self._connect()
        except BaseException as exc:  # handed to the waiting thread
            error = exc
        with self._lock:
            if self._abandoned:
                if conn is not None:
                    conn.close()
                return
            self._conn, self._error = conn, error
            self._done.set()

    def result(self, timeout: float) -> psycopg.Connection[Any] | None:
        """The connection, or None when it did not come within ``timeout``;
        raises what connecting raised."""
        self._done.wait(timeout)
        with self._lock:
            if not self._done.is_set():
                self._abandoned = True
                return None
        if self._error is not None:
            raise self._error
        return self._conn


class Watchdog:
    """A daemon thread that frees stalled connections (see the module docstring).

    ``connect`` returns a new psycopg connection each call (normally
    :func:`sa_jobqueue.connections.raw_connect` of the application's engine);
    the watchdog uses one per check, to read ``pg_stat_activity`` and to
    terminate a backend, closes it afterwards and names its session
    ``application_name`` (``None``: as the engine named it). A connect that
    takes longer than ``check_timeout`` is given up (no other is started
    while it hangs), as is a check that takes longer once connected; the
    watchdog logs it and looks again at its next interval.
    """

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        *,
        after: float,
        interval: float = 1.0,
        check_timeout: float = 5.0,
        application_name: str | None = WATCHDOG_APPLICATION_NAME,
    ) -> None:
        if not callable(connect):
            raise TypeError(f"connect must be a callable returning a psycopg connection, got {connect!r}")
        self._connect = connect
        self._after = after
        self._interval = interval
        self._check_timeout = check_timeout
        self._application_name = application_name
        self._key = object()  # this watchdog's entry in each connection's info
        self._backends: weakref.WeakSet[StatementRecord] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sa_jobqueue-watchdog", daemon=True)
        self._hanging: _Attempt | None = None  # a connect given up on, its thread maybe still waiting
        #: Backends terminated so far (for logs and tests).
        self.freed = 0
        #: Looks at the watched statements completed so far (for tests).
        self.looks = 0

    def watch_engine(self, engine: Engine) -> Callable[[], None]:
        """Watch the statements of every connection of ``engine``'s pool
        (see the module docstring) until the returned function is called; it
        may be called once.

        Give it the worker's own engine. Engines made from it with
        ``execution_options()`` share its pool, so theirs are watched too;
        those of any other engine are not. The event is registered on the
        pool as of now (it follows the pool through
        :meth:`~sqlalchemy.engine.Engine.dispose`). Connections that are not
        psycopg 3 connections are ignored.
        """
        pool = engine.pool

        def checkout(dbapi_connection: Any, connection_record: Any, *rest: Any) -> None:
            # Once per DBAPI connection: its cursors stay watched for its life.
            if self._key not in connection_record.info:
                self._watch(dbapi_connection, connection_record.info)

        event.listen(pool, "checkout", checkout)

        def unwatch() -> None:
            # Removed from the pool it was added to: a pool recreated by
            # dispose() holds a copy that goes with it.
            event.remove(pool, "checkout", checkout)

        return unwatch

    def watch_jobs(self) -> Callable[[Any], ConnectionWatch]:
        """Watch the statements of the connections the worker's jobs hold on
        the application's engine, and only those, while they hold them.

        Returns ``own``: ``own(connection)``, called in the thread that holds
        the :class:`~sqlalchemy.engine.Connection`, watches it and returns its
        :class:`ConnectionWatch`, which that thread releases before the
        connection goes back to the pool. A statement of a connection not
        owned so (the application's own, in the same process) is never looked
        at, so it is never ended.
        """

        def own(connection: Any) -> ConnectionWatch:
            dbapi_connection = connection.connection.dbapi_connection
            backend = self._watch(dbapi_connection, connection.info, permanent=False)
            previous = watch_cursors(dbapi_connection, backend) if backend is not None else NOT_WATCHABLE
            if previous is NOT_WATCHABLE:
                return NOT_WATCHED
            return ConnectionWatch(backend, dbapi_connection, previous)

        return own

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    # -- in the threads that execute -------------------------------------------

    def _watch(self, dbapi_connection: Any, info: dict[Any, Any], *, permanent: bool = True) -> StatementRecord | None:
        """The record of a connection, made on first sight by the thread that
        owns it (reading libpq there is safe); with ``permanent``, its cursors
        are watched from now on. None for a connection that is not psycopg's."""
        backend = info.get(self._key)
        if backend is None:
            if not isinstance(dbapi_connection, psycopg.Connection):
                info[self._key] = _UNWATCHED
                return None
            backend = StatementRecord(
                pid=dbapi_connection.info.backend_pid, fd=dbapi_connection.fileno()
            )
            info[self._key] = backend
            with self._lock:
                self._backends.add(backend)
            if permanent:
                watch_cursors(dbapi_connection, backend)
        return backend if isinstance(backend, StatementRecord) else None

    # -- in the watchdog's thread -----------------------------------------------

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            try:
                suspects = self._suspects()
                if suspects:
                    self._check(suspects)
            except Exception:  # never let the watchdog die
                log.exception("watchdog: check failed")
            self.looks += 1

    def _suspects(self) -> list[tuple[StatementRecord, int, float]]:
        """Statements in flight for ``after`` seconds: (backend, which statement, since)."""
        with self._lock:
            backends = list(self._backends)
        found = []
        for backend in backends:
            with backend.lock:
                found += suspects([backend], now=time.monotonic(), after=self._after)
        return found

    def _check(self, suspects: list[tuple[StatementRecord, int, float]]) -> None:
        states = self._backend_states(sorted({backend.pid for backend, _, _ in suspects}))
        for backend, statement, since in suspects:
            state, age = states.get(backend.pid, ("unknown", 0.0))
            with backend.lock:
                if not is_stalled(backend, statement, state=state, age=age, after=self._after):
                    continue
            log.warning(
                "watchdog: backend %s waited on for %.0f s but %s on the server: the connection is stalled; "
                "terminating it", backend.pid, time.monotonic() - since, state,
            )
            self._terminate(backend.pid)
            with backend.lock:
                # Only while the same statement is in flight: its owner is
                # still inside the call, so the socket is still this connection's.
                if backend.statement == statement and backend.since is not None:
                    shutdown_socket(backend.fd)
                    backend.since = None
            self.freed += 1

    def _backend_states(self, pids: list[int]) -> dict[int, tuple[str, float]]:
        rows = self._query(_STATES, (pids,))
        return {int(pid): (str(state), float(age or 0.0)) for pid, state, age in rows}

    def _terminate(self, pid: int) -> None:
        try:
            self._query("SELECT pg_terminate_backend(%s)", (pid,))
        except Exception as exc:
            log.warning("watchdog: could not terminate backend %s: %s", pid, exc)

    def _query(self, query: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Run one query on a connection of the watchdog's own, given up if
        connecting or the query takes longer than ``check_timeout`` each
        (that connection may stall too)."""
        if self._hanging is not None and self._hanging.thread.is_alive():
            raise TimeoutError("the watchdog's previous connection attempt still hangs")
        attempt = _Attempt(self._connect)
        conn = attempt.result(self._check_timeout)
        if conn is None:
            self._hanging = attempt
            raise TimeoutError(f"the watchdog could not connect within {self._check_timeout:.1f} s")
        self._hanging = None
        with conn, socket_deadline(conn.fileno(), self._check_timeout):
            own_session(conn, self._application_name)
            return list(conn.execute(query, params).fetchall())


