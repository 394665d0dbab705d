"""Shutdown: SIGINT and SIGTERM, the way Sidekiq and Celery users expect.

The first signal asks for a graceful stop: the worker stops claiming,
hands back the jobs it claimed but did not start, waits for the running
ones up to its ``shutdown_timeout``, then returns, leaving jobs still
running to their lease. A second signal stops at once: the worker returns
without waiting (what is still running or unstarted comes back when its
lease expires).

Signal handlers can only be installed from the main thread; a worker run
in another thread is stopped with :meth:`Worker.stop` instead.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sa_jobqueue.worker")


class Shutdown:
    """The stop requests of one worker: graceful first, then immediate."""

    def __init__(self, name: str, stopping: threading.Event, wake: threading.Event) -> None:
        self.name = name
        self.stopping = stopping
        self.wake = wake
        self.abort = threading.Event()

    def request(self) -> None:
        """A stop request: the first is graceful, the next one immediate."""
        if self.stopping.is_set():
            self.abort.set()
        self.stopping.set()
        self.wake.set()

    def install(self) -> Callable[[], None]:
        """Route SIGINT and SIGTERM to :meth:`request`; return the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def on_signal(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            if self.stopping.is_set():
                log.warning("worker %s: %s received again, stopping at once", self.name, name)
            else:
                log.info("worker %s: %s received, stopping: claimed jobs not started are handed back, "
                         "running jobs finish (a second signal stops at once)", self.name, name)
            self.request()

        for sig in previous:
            signal.signal(sig, on_signal)

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore
