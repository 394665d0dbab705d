"""Slots: the worker's threads, fed from one queue.

A worker hands each claimed job (lease mode) or each batch probe
(transaction mode) to ``size`` long-lived threads through a
:class:`queue.SimpleQueue`. This costs far less per job than a
``concurrent.futures`` pool (no Future, no callback list, no set to scan),
which matters when a claim brings a hundred no-op jobs at once.

What the worker relies on: calls start in submission order, at most
``size`` at a time; ``len(slots)`` counts calls submitted and not finished;
``on_done(active)`` runs in the slot's thread after each call with the count
left; an exception escaping a call is logged and counted as "found nothing"
and never kills a thread; :meth:`close` waits for every submitted call.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sa_jobqueue.worker")

_STOP = None


class Slots:
    """``size`` threads running submitted calls; each call returns whether it found work."""

    def __init__(self, size: int, *, name: str, on_done: Callable[[int], None]) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., bool], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._on_done = on_done
        self._active = 0
        self._ran = 0
        self._empty = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{n}", daemon=False) for n in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def __len__(self) -> int:
        with self._lock:
            return self._active

    def submit(self, call: Callable[..., bool], *args: Any) -> None:
        with self._lock:
            self._active += 1
        self._queue.put((call, args))

    def take_results(self) -> tuple[int, int, int]:
        """How many finished calls found work and how many found none since the
        last take, and how many calls are still in flight: one snapshot, so a
        call is either counted as finished or as in flight, never neither."""
        with self._lock:
            ran, empty, self._ran, self._empty = self._ran, self._empty, 0, 0
            return ran, empty, self._active

    def close(self) -> None:
        """Let the submitted calls finish, then end the threads."""
        for _ in self._threads:
            self._queue.put(_STOP)
        for thread in self._threads:
            thread.join()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            call, args = item
            try:
                found = bool(call(*args))
            except BaseException:  # a database error outside a handler: log, keep the thread
                log.exception("job slot failed")
                found = False
            with self._lock:
                self._active -= 1
                active = self._active
                if found:
                    self._ran += 1
                else:
                    self._empty += 1
            self._on_done(active)
