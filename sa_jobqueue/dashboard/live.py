"""Live updates for the dashboard: NOTIFYs of the job tables, fanned out to the pages' event streams.

One :class:`~sa_jobqueue.listener.Listener` per dashboard (one connection,
however many browsers watch) LISTENs on the job tables' channels; each page's
Server-Sent Events stream waits on :meth:`Broadcast.wait`, which returns when a
notification arrives or after the poll interval, whichever comes first, so a
page is refreshed at least every poll interval where NOTIFY is off (behind
PgBouncer in transaction mode, or ``listen=False``) and at once where it works.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

from sqlalchemy import Engine

from ..connections import raw_connect
from ..listener import Listener

APPLICATION_NAME = "sa_jobqueue-dashboard"


class Broadcast:
    """Tells every waiting event stream that a job table changed."""

    def __init__(self, engine: Engine, channels: Sequence[str], *, listen: bool) -> None:
        self._engine = engine
        self._channels = list(channels)
        self._listen = listen
        self._lock = threading.Lock()
        # Each waiting stream's event, and how to set it from the listener's thread.
        self._waiting: dict[object, Callable[[], None]] = {}
        self._listener: Listener | None = None

    def _notified(self, channel: str, payload: str) -> None:
        with self._lock:
            wakes = list(self._waiting.values())
        for wake in wakes:
            wake()

    def _start(self) -> None:
        with self._lock:
            if self._listener is not None or not self._listen:
                return
            self._listener = Listener(raw_connect(self._engine), self._channels, self._notified, lambda: None,
                                      application_name=APPLICATION_NAME)
        self._listener.start()

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """Wait until a job table is notified (True) or ``timeout`` seconds pass (False)."""
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            event.clear()

    def wait_thread(self, event: threading.Event, timeout: float) -> bool:
        """:meth:`wait`, for a stream served by a thread (:meth:`subscribe_thread`)."""
        notified = event.wait(timeout)
        event.clear()
        return notified

    def subscribe(self) -> asyncio.Event:
        """An event set at every notification, for the calling event loop; :meth:`unsubscribe` it after."""
        self._start()
        event = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wake() -> None:
            loop.call_soon_threadsafe(event.set)

        with self._lock:
            self._waiting[event] = wake
        return event

    def subscribe_thread(self) -> threading.Event:
        """:meth:`subscribe`, for a stream served by a thread (a WSGI server's)."""
        self._start()
        event = threading.Event()
        with self._lock:
            self._waiting[event] = event.set
        return event

    def unsubscribe(self, event: object) -> None:
        with self._lock:
            self._waiting.pop(event, None)

    def stop(self) -> None:
        """Stop listening (the app's shutdown)."""
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()


__all__ = ["APPLICATION_NAME", "Broadcast"]
