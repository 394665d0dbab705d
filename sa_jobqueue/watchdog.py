"""Watchdog: frees connections stalled behind a half-open network path.

A connection can stall with a statement in flight: a proxy, pooler or NAT
in between stops forwarding while still acknowledging TCP, so keepalives and
``tcp_user_timeout`` never fire, and ``statement_timeout`` never starts
because the statement never reached the server. The calling thread then
waits forever: a job slot, a claim, or the worker's whole loop.

A long statement and a stalled one look alike from the client (a command in
progress, no reply yet), so the watchdog asks the server. Every
``interval`` it looks at the connections it watches; one that has had a
command in progress (libpq's ``PQTRANS_ACTIVE``) at every look for
``after`` seconds is a suspect, and the watchdog reads the state of its
backend in ``pg_stat_activity`` over a connection of its own. A backend
that is not ``active`` and has not changed state for ``after`` seconds
either (its server side sat idle all along: the statement never arrived, or
its reply never came back), seen so in two checks in a row, is a stall. (A
busy connection runs one short statement after another: it can look
"in progress" at every look, but its backend's state keeps changing.) The
watchdog terminates that backend (which gives back its row locks at once)
and shuts the client's socket down, so the waiting call fails as a
disconnect and the worker's usual error paths take over (a claim is
retried, a job's attempt fails and is retried).

What a caller may rely on: a statement that is running on the server is
never interrupted, however long it takes; a backend the watchdog cannot see
(behind PgBouncer, whose backend ids are its own) is never acted upon.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import psycopg
from psycopg import pq

log = logging.getLogger("sa_jobqueue.worker")

# The backend's state, and for how long it has been in it (server clock).
_STATES = (
    "SELECT pid, state, extract(epoch FROM now() - state_change) "
    "FROM pg_stat_activity WHERE pid = ANY(%s)"
)


def shutdown_socket(fd: int) -> None:
    """Shut down the socket behind ``fd`` (both directions) without closing
    ``fd``: the connection's owner sees its call fail and closes it."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


class Watchdog:
    """A daemon thread watching psycopg connections for stalls (see the module docstring)."""

    def __init__(self, conninfo: str, *, after: float, interval: float = 1.0, check_timeout: float = 5.0) -> None:
        self._conninfo = conninfo
        self._after = after
        self._interval = interval
        self._check_timeout = check_timeout
        self._watched: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
        # Per connection: (monotonic time its current command was first seen
        # in progress, how many checks in a row found its backend not active).
        self._active: weakref.WeakKeyDictionary[psycopg.Connection[Any], list[float]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sa_jobqueue-watchdog", daemon=True)
        #: Backends terminated so far (for logs and tests).
        self.freed = 0

    def watch(self, conn: Any) -> None:
        """Watch a psycopg 3 connection (others are ignored) until it is garbage."""
        if isinstance(conn, psycopg.Connection):
            with self._lock:
                self._watched.add(conn)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            try:
                suspects = self._suspects()
                if suspects:
                    self._check(suspects)
            except Exception:  # never let the watchdog die
                log.exception("watchdog: check failed")

    def _suspects(self) -> dict[int, psycopg.Connection[Any]]:
        """Connections with one command in progress for ``after`` seconds, by backend pid."""
        now = time.monotonic()
        with self._lock:
            watched = list(self._watched)
        suspects: dict[int, psycopg.Connection[Any]] = {}
        for conn in watched:
            if conn.closed or conn.pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
                self._active.pop(conn, None)
                continue
            seen = self._active.setdefault(conn, [now, 0.0])
            if now - seen[0] >= self._after:
                suspects[conn.info.backend_pid] = conn
        return suspects

    def _check(self, suspects: dict[int, psycopg.Connection[Any]]) -> None:
        states = self._backend_states(list(suspects))
        for pid, conn in suspects.items():
            seen = self._active.get(conn)
            if seen is None:
                continue
            found = states.get(pid)
            if found is None or found[0] == "active" or found[1] < self._after:
                # Unknown to this server (a pooler's id), running, or busy with
                # other statements lately: leave it.
                seen[1] = 0
                continue
            state = found[0]
            seen[1] += 1
            if seen[1] < 2:
                continue  # confirm on the next check: the reply may have been in flight
            log.warning(
                "watchdog: backend %s waited on for %.0f s but %s on the server: the connection is stalled; "
                "terminating it", pid, time.monotonic() - seen[0], state,
            )
            self._terminate(pid)
            shutdown_socket(conn.pgconn.socket)
            self._active.pop(conn, None)
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
        """Run one query on a connection of the watchdog's own, which is shut
        down if it takes longer than ``check_timeout`` (it may stall too)."""
        with psycopg.connect(
            self._conninfo, autocommit=True, connect_timeout=max(1, int(self._check_timeout)),
            application_name="sa_jobqueue watchdog",
        ) as conn:
            timer = threading.Timer(self._check_timeout, shutdown_socket, (conn.pgconn.socket,))
            timer.daemon = True
            timer.start()
            try:
                return list(conn.execute(query, params).fetchall())
            finally:
                timer.cancel()
