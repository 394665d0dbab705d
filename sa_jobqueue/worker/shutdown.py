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
import os
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
        """Route SIGINT and SIGTERM to :meth:`request`; return the undo.

        The Python-level handlers do nothing: a handler runs in the main
        thread between two bytecodes, possibly while that thread holds the
        lock of the very event it would set (the loop waits on ``wake``), and
        would then wait on that lock forever. Instead the interpreter's C
        handler writes the signal's number to a pipe (``signal.set_wakeup_fd``),
        and a thread of its own reads it and makes the request, taking locks
        as any thread may.
        """
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd requires it: a signal must never block
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        for sig in previous:
            signal.signal(sig, _noted)
        reader = threading.Thread(target=self._read, args=(read_fd,), name="sa_jobqueue-signals", daemon=True)
        reader.start()

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_fd)
            os.close(write_fd)  # the reader sees the end of the pipe, closes its end and returns
            reader.join(5)

        return restore

    def _read(self, read_fd: int) -> None:
        """The signals thread: a request per SIGINT or SIGTERM the pipe reports."""
        try:
            while True:
                numbers = os.read(read_fd, 64)
                if not numbers:
                    return
                for number in numbers:
                    if number in _SIGNALS:
                        self._received(signal.Signals(number).name)
        finally:
            os.close(read_fd)

    def _received(self, name: str) -> None:
        if self.stopping.is_set():
            log.warning("worker %s: %s received again, stopping at once", self.name, name)
        else:
            log.info("worker %s: %s received, stopping: claimed jobs not started are handed back, "
                     "running jobs finish (a second signal stops at once)", self.name, name)
        self.request()


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _noted(signum: int, frame: Any) -> None:
    """The Python-level handler: nothing, as the wakeup pipe carries the signal (see :meth:`Shutdown.install`)."""
