"""AsyncListener: LISTEN/NOTIFY wake-ups for the asyncio worker, on an async connection.

What :class:`sa_jobqueue.listener.Listener` is to the thread worker, as a
task on the event loop: one connection of its own (made as the
application's engine makes its connections, see
:func:`sa_jobqueue.connections.driver_connect`), LISTEN on every channel,
``on_notify(channel, payload)`` for each notification and ``on_connect()``
after each (re)connection, so that the worker polls once for anything it
missed. Polling stays the contract; a lost notification costs at most one
poll interval.

The two drivers deliver notifications differently: psycopg's
``AsyncConnection`` through its ``notifies()`` generator (notifications
that arrive between two calls are kept for the next, since psycopg 3.2);
asyncpg through ``add_listener`` callbacks while the loop runs. Either way the listener
probes its connection with ``SELECT 1`` every ``probe_interval`` seconds
and reconnects, with backoff, when the probe fails or takes longer than
``probe_timeout`` (a half-open connection never reports an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from ..listener import LISTENER_APPLICATION_NAME

log = logging.getLogger("sa_jobqueue.listener")

__all__ = ["AsyncListener"]


class AsyncListener:
    """A task that LISTENs on ``channels`` and reports notifications (see the module docstring).

    ``connect`` is awaited for each new connection and returns the driver's
    connection (psycopg's ``AsyncConnection`` or asyncpg's ``Connection``),
    which the listener owns and closes.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        channels: Sequence[str],
        *,
        on_notify: Callable[[str, str], None],
        on_connect: Callable[[], None] = lambda: None,
        probe_interval: float = 5.0,
        probe_timeout: float = 5.0,
        application_name: str | None = LISTENER_APPLICATION_NAME,
        max_backoff: float = 5.0,
    ) -> None:
        self._connect = connect
        self.channels = list(channels)
        self.on_notify = on_notify
        self.on_connect = on_connect
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.application_name = application_name
        self.max_backoff = max_backoff
        #: Set while a connection LISTENs on every channel.
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sa_jobqueue-listener")

    async def stop(self) -> None:
        """Stop listening and close the connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            conn: Any = None
            try:
                conn = await self._connect()
                if isinstance(conn, psycopg.AsyncConnection):
                    await self._listen_psycopg(conn)
                else:
                    await self._listen_asyncpg(conn)
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("listener: %r; reconnecting in %.2f s", exc, backoff)
            finally:
                self.connected.clear()
                if conn is not None:
                    await close_quietly(conn)
            await asyncio.sleep(backoff)
            backoff = min(self.max_backoff, backoff * 2)

    async def _listen_psycopg(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            await conn.rollback()
        await conn.set_autocommit(True)
        for channel in self.channels:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        if self.application_name is not None:
            await conn.execute("SELECT set_config('application_name', %s, false)", (self.application_name,))
        self._connected()
        while True:
            # notifies() reads the socket until the timeout; those that arrive
            # during a probe are kept by psycopg (3.2+) for the next call.
            async for notify in conn.notifies(timeout=self.probe_interval):
                self.on_notify(notify.channel, notify.payload)
            await asyncio.wait_for(conn.execute("SELECT 1"), self.probe_timeout)

    async def _listen_asyncpg(self, conn: Any) -> None:
        def deliver(_conn: Any, _pid: int, channel: str, payload: str) -> None:
            self.on_notify(channel, payload)

        for channel in self.channels:
            await conn.add_listener(channel, deliver)
        if self.application_name is not None:
            await conn.execute("SELECT set_config('application_name', $1, false)", self.application_name)
        self._connected()
        while True:
            await asyncio.sleep(self.probe_interval)
            await asyncio.wait_for(conn.fetchval("SELECT 1"), self.probe_timeout)

    def _connected(self) -> None:
        self.connected.set()
        self.on_connect()


async def close_quietly(conn: Any) -> None:
    """Close a driver connection, never raising (it may be broken already)."""
    try:
        if isinstance(conn, psycopg.AsyncConnection):
            await asyncio.wait_for(conn.close(), 2.0)
        else:
            conn.terminate()  # asyncpg: no round trip, the connection may be half-open
    except Exception:  # pragma: no cover - closing a broken connection
        log.debug("listener: closing the connection failed", exc_info=True)
