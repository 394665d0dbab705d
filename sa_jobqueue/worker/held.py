"""HeldConnections and KeptConnections: connections of an engine held across calls.

Checking a connection out of the pool, applying its execution options and
giving it back costs the worker's threads more than the short statement
they send in between, most of all after an idle wait, when that code runs
cold. So a thread that runs statement after statement (a slot's jobs, a
claimer's claims) holds one :class:`~sqlalchemy.engine.Connection` from its
first call of :meth:`HeldConnections.connection` until it calls
:meth:`HeldConnections.release`.

What a caller may rely on: :meth:`connection` returns the calling thread's
connection, with the execution options given, checking out a new one when
the thread holds none or when the last one was invalidated or closed (an
error made it unusable: the pool replaces it); :meth:`release`, called in
that thread, returns it to the pool (a broken one is discarded there);
:attr:`held` counts the connections held by all threads. A released
connection's pool applies ``pool_pre_ping`` and ``pool_recycle`` at its
next checkout; a held one meets them only once it is released.

:class:`KeptConnections` does the same for callers that share one thread
(the asyncio worker's claims, each in a greenlet of the event loop's
thread): a connection is taken for a call and given back after it, kept
for the next call rather than returned to the pool.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import Connection, Engine


class HeldConnections:
    """One held connection of ``engine`` per thread (see the module docstring)."""

    def __init__(self, engine: Engine, **execution_options: Any) -> None:
        self.engine = engine
        self._options = execution_options
        self._local = threading.local()
        self._lock = threading.Lock()
        self.held = 0  # connections the threads hold right now

    def connection(self) -> Connection:
        """This thread's connection; raises what connecting raises (nothing is held then)."""
        connection: Connection | None = getattr(self._local, "connection", None)
        if connection is not None and (connection.invalidated or connection.closed):
            self.release()  # made unusable by the last call: check out another
            connection = None
        if connection is None:
            connection = self.engine.connect()
            try:
                if self._options:
                    connection.execution_options(**self._options)
            except BaseException:
                connection.close()
                raise
            self._local.connection = connection
            with self._lock:
                self.held += 1
        return connection

    def release(self) -> None:
        """This thread's connection goes back to the pool (nothing happens if it holds none)."""
        connection: Connection | None = getattr(self._local, "connection", None)
        if connection is None:
            return
        self._local.connection = None
        with self._lock:
            self.held -= 1
        _close(connection)


class KeptConnections:
    """Connections of ``engine`` kept between the calls of callers that share
    a thread: :meth:`take` returns a kept one, or checks out a new one when
    none is kept or the kept ones were invalidated or closed (an error made
    them unusable); :meth:`give` keeps it for the next caller, or gives an
    unusable one back to the pool, which discards it; :meth:`release` gives
    the kept ones back to the pool, and any given after it too (a call that
    outlived its caller's end keeps nothing). At most as many are kept as
    were taken at once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._idle: list[Connection] = []
        self._released = False

    def take(self) -> Connection:
        """A connection for one call; raises what connecting raises (nothing is kept then)."""
        while self._idle:
            connection = self._idle.pop()
            if not (connection.invalidated or connection.closed):
                return connection
            _close(connection)
        return self.engine.connect()

    def give(self, connection: Connection) -> None:
        """The call is over: keep ``connection`` for the next one, unless it is unusable."""
        if self._released or connection.invalidated or connection.closed:
            _close(connection)
        else:
            self._idle.append(connection)

    def release(self) -> None:
        """Give every kept connection back to the pool, and from now on each one given."""
        self._released = True
        idle, self._idle = self._idle, []
        for connection in idle:
            _close(connection)


def _close(connection: Connection) -> None:
    try:
        connection.close()
    except Exception:  # a broken connection: the pool discards it
        pass
