"""Listener: LISTEN/NOTIFY wake-ups for a worker, as a hint on top of polling.

Enqueueing sends ``NOTIFY <channel>, '<queue>'`` at most once per transaction
and queue (see :meth:`JobRepository.enqueue_many`); a worker's listener holds
one connection of its own, LISTENs on the channels of its job tables and
calls back on every notification, so an idle worker claims at once instead of
at its next poll. Polling stays the contract: a lost notification (listener
reconnecting, server restart) costs at most one poll interval.

The connection comes from a factory, normally
:func:`sa_jobqueue.connections.raw_connect` of the application's engine, so
it is made as the engine makes its own (SSL, ``options``, a ``creator``,
``do_connect`` events); connect and TCP keepalive settings are the engine's
too (its ``connect_args``). The listener then turns it into an autocommit
session named ``application_name``.

The listener reconnects by itself with backoff, and calls ``on_connect``
after each (re)connection so the worker polls once for anything it missed.
A connection can go half-open behind a peer that still answers TCP (a
stalled proxy or pooler, flows dropped past the next hop): keepalives then
succeed and no notification ever arrives. So the listener also probes its
connection with a ``SELECT 1`` every ``probe_interval`` seconds and gives up
on it when the reply takes longer than ``probe_timeout``: it shuts the socket
down, which fails the read, and reconnects. That also bounds how long a
connection whose server vanished goes unnoticed when the engine sets no
keepalives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from .connections import own_session
from .sockets import socket_deadline

log = logging.getLogger("sa_jobqueue.listener")

#: The ``application_name`` of a listener's session, unless told otherwise.
LISTENER_APPLICATION_NAME = "sa_jobqueue listener"


class Listener:
    """A daemon thread that LISTENs on ``channels`` and reports notifications.

    ``connect`` returns a new psycopg connection each call, which the
    listener owns and closes (see the module docstring). Once a connection
    LISTENs on every channel, the listener names its session
    ``application_name`` (``None``: keep the name the engine gave it), sets
    :attr:`connected` and calls ``on_connect()``: so a session found under
    that name in ``pg_stat_activity`` already LISTENs. Then it calls
    ``on_notify(channel, payload)`` for every notification, in its own
    thread, until :meth:`stop`. Exceptions from connecting or from the
    connection are logged and followed by a reconnection with backoff;
    exceptions from the callbacks too (the callbacks must not raise).
    """

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        channels: Sequence[str],
        on_notify: Callable[[str, str], None],
        on_connect: Callable[[], None],
        *,
        application_name: str | None = LISTENER_APPLICATION_NAME,
        check_interval: float = 1.0,
        max_backoff: float = 10.0,
        probe_interval: float = 10.0,
        probe_timeout: float = 5.0,
    ) -> None:
        if not callable(connect):
            raise TypeError(f"connect must be a callable returning a psycopg connection, got {connect!r}")
        self._connect = connect
        self._channels = list(channels)
        self._on_notify = on_notify
        self._on_connect = on_connect
        self._application_name = application_name
        self._check_interval = check_interval
        self._max_backoff = max_backoff
        self._probe_interval = probe_interval
        self._probe_timeout = probe_timeout
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sa_jobqueue-listener", daemon=True)
        #: Set while the listener's connection LISTENs on every channel.
        self.connected = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening and wait up to ``timeout`` seconds for the thread to
        close its connection (the server may see the session end later)."""
        self._stopping.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.2
        while not self._stopping.is_set():
            try:
                with self._connect() as conn:
                    own_session(conn)
                    for channel in self._channels:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    # Named only once it LISTENs: whoever finds the session by
                    # its name may rely on notifications reaching it.
                    if self._application_name is not None:
                        conn.execute("SELECT set_config('application_name', %s, false)", (self._application_name,))
                    self.connected.set()
                    backoff = 0.2
                    self._on_connect()
                    next_probe = time.monotonic() + self._probe_interval
                    while not self._stopping.is_set():
                        # notifies() returns after the timeout, so the stop flag
                        # is seen within check_interval.
                        for note in conn.notifies(timeout=self._check_interval):
                            self._on_notify(note.channel, note.payload)
                        if time.monotonic() >= next_probe:
                            # Notifications that arrive during the probe are
                            # kept by psycopg for the next notifies().
                            self._probe(conn)
                            next_probe = time.monotonic() + self._probe_interval
            except Exception as exc:  # any failure: reconnect after a pause
                self.connected.clear()
                if self._stopping.is_set():
                    break
                log.warning("listener: %s; reconnecting in %.1f s", exc, backoff)
                self._stopping.wait(backoff)
                backoff = min(self._max_backoff, backoff * 2)
        self.connected.clear()

    def _probe(self, conn: psycopg.Connection[Any]) -> None:
        """One round trip with a deadline; past it, shut the socket down so
        that the waiting read fails instead of waiting forever."""
        with socket_deadline(conn.fileno(), self._probe_timeout) as deadline:
            try:
                conn.execute("SELECT 1")
            finally:
                if deadline.expired:
                    log.warning("listener: no reply to the liveness probe within %.1f s", self._probe_timeout)
