"""HeldConnections: one connection of an engine per thread, held across calls.

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
        try:
            connection.close()
        except Exception:  # a broken connection: the pool discards it
            pass
