"""Listener: LISTEN/NOTIFY wake-ups for a worker, as a hint on top of polling.

Enqueueing sends ``NOTIFY <channel>, '<queue>'`` at most once per transaction
and queue (see :meth:`JobRepository.enqueue_many`); a worker's listener holds
one connection of its own, LISTENs on the channels of its job tables and
calls back on every notification, so an idle worker claims at once instead of
at its next poll. Polling stays the contract: a lost notification (listener
reconnecting, server restart) costs at most one poll interval.

The listener reconnects by itself with backoff, and calls ``on_connect``
after each (re)connection so the worker polls once for anything it missed.
TCP keepalives make a connection whose peer vanished fail within about half a
minute. A connection can also go half-open behind a peer that still answers
TCP (a stalled proxy or pooler, flows dropped past the next hop): keepalives
then succeed and no notification ever arrives. So the listener also probes
its connection with a ``SELECT 1`` every ``probe_interval`` seconds and gives
up on it when the reply takes longer than ``probe_timeout``: it shuts the
socket down, which fails the read, and reconnects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import psycopg
from psycopg import sql

from .watchdog import shutdown_socket

log = logging.getLogger("sa_jobqueue.listener")

CHANNEL_PREFIX = "sa_jobqueue_"


def channel_name(table_name: str) -> str:
    """The NOTIFY channel of a job table: one per table, named after it."""
    return f"{CHANNEL_PREFIX}{table_name}"


class Listener:
    """A daemon thread that LISTENs on ``channels`` and reports notifications."""

    def __init__(
        self,
        conninfo: str,
        channels: Sequence[str],
        on_notify: Callable[[str, str], None],
        on_connect: Callable[[], None],
        *,
        check_interval: float = 1.0,
        max_backoff: float = 10.0,
        probe_interval: float = 10.0,
        probe_timeout: float = 5.0,
    ) -> None:
        self._conninfo = conninfo
        self._channels = list(channels)
        self._on_notify = on_notify
        self._on_connect = on_connect
        self._check_interval = check_interval
        self._max_backoff = max_backoff
        self._probe_interval = probe_interval
        self._probe_timeout = probe_timeout
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sa_jobqueue-listener", daemon=True)
        self.connected = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.2
        while not self._stopping.is_set():
            try:
                with psycopg.connect(
                    self._conninfo, autocommit=True, connect_timeout=10,
                    keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
                    application_name="sa_jobqueue listener",
                ) as conn:
                    for channel in self._channels:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
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

    def _probe(self, conn: psycopg.Connection[object]) -> None:
        """One round trip with a deadline; past it, shut the socket down so
        that the waiting read fails instead of waiting forever."""
        answered = threading.Event()
        fd = conn.fileno()

        def give_up() -> None:
            if not answered.is_set():
                log.warning("listener: no reply to the liveness probe within %.1f s", self._probe_timeout)
                shutdown_socket(fd)

        timer = threading.Timer(self._probe_timeout, give_up)
        timer.daemon = True
        timer.start()
        try:
            conn.execute("SELECT 1")
        finally:
            answered.set()
            timer.cancel()

