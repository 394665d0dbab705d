"""Slots: the worker's threads, fed from one queue.

A worker hands each claimed job (lease mode) or each batch probe
(transaction mode) to ``size`` long-lived threads through a
:class:`queue.SimpleQueue`. This costs far less per job than a
``concurrent.futures`` pool (no Future, no callback list, no set to scan),
which matters when a claim brings a hundred no-op jobs at once.

What the worker relies on: calls start in submission order, at most
``size`` at a time; ``len(slots)`` counts calls submitted and not finished,
each by its ``weight`` (the jobs it runs: a group of jobs is one call);
``on_done(active)`` runs in the slot's thread after each call with the count
left; ``on_idle()`` runs in a slot's thread when it finds no call waiting,
before it waits for one, and when the thread ends (a slot gives back what
it held for its calls there); ``on_exit()``, when the thread ends only (what
a slot holds while it waits too); an exception escaping a call is logged and counted as "found nothing"
and never kills a thread; :meth:`take_unstarted` removes the calls no thread
has started; :meth:`abandon` gives up on a thread stuck in a call (a Python
thread cannot be killed): the call counts as finished, a new thread takes
its place, and the stuck one ends when its call returns, if ever. Threads
are daemons, so a stuck one never keeps the process from exiting;
:meth:`close` waits for every submitted call, :meth:`wait_idle` for a time.
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

    def __init__(
        self, size: int, *, name: str, on_done: Callable[[int], None], on_idle: Callable[[], None] | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., bool], tuple[Any, ...], int] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._on_done = on_done
        self._on_idle = on_idle
        self._on_exit = on_exit
        self._active = 0
        self._ran = 0
        self._empty = 0
        self._idle = threading.Condition(self._lock)
        self._name = name
        self._abandoned: set[int] = set()
        self._weights: dict[int, int] = {}  # by thread: the weight of the call it runs
        self.stuck = 0
        self._threads: list[threading.Thread] = []
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        thread = threading.Thread(target=self._serve, name=f"{self._name}-{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def __len__(self) -> int:
        with self._lock:
            return self._active

    def submit(self, call: Callable[..., bool], *args: Any, weight: int = 1) -> None:
        with self._lock:
            self._active += weight
        self._queue.put((call, args, weight))

    def submit_each(self, call: Callable[..., bool], args: list[Any]) -> None:
        """``submit(call, arg)`` for each of ``args``, in order, counted in flight at once."""
        with self._lock:
            self._active += len(args)
        put = self._queue.put
        for arg in args:
            put((call, (arg,), 1))

    def take_results(self) -> tuple[int, int, int]:
        """How many finished calls found work and how many found none since the
        last take, and how many calls are still in flight: one snapshot, so a
        call is either counted as finished or as in flight, never neither."""
        with self._lock:
            ran, empty, self._ran, self._empty = self._ran, self._empty, 0, 0
            return ran, empty, self._active

    def take_unstarted(self) -> list[tuple[Any, ...]]:
        """Remove the calls no thread has started; return their arguments, in order."""
        taken: list[tuple[Any, ...]] = []
        weight = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:  # pragma: no cover - close() is not called concurrently
                self._queue.put(item)
                break
            taken.append(item[1])
            weight += item[2]
        with self._lock:
            self._active -= weight
            self._idle.notify_all()
        return taken

    def abandon(self, ident: int, *, stuck: bool = True) -> bool:
        """Give up on the thread ``ident``, stuck in a call: count the call as
        finished and start a thread in its place (``stuck``: count it in
        :attr:`stuck`, a handler's hang rather than a network's). False if it
        is not ours or already given up on."""
        with self._lock:
            live = {t.ident for t in self._threads if t.is_alive()}
            if ident not in live or ident in self._abandoned:
                return False
            self._abandoned.add(ident)
            self.stuck += stuck
            self._active -= self._weights.pop(ident, 1)
            self._idle.notify_all()
            self._spawn()
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is in flight, for at most ``timeout`` seconds; True if idle."""
        with self._idle:
            return self._idle.wait_for(lambda: self._active <= 0, timeout)

    def close(self, *, wait: bool = True) -> None:
        """End the threads once the submitted calls finish (``wait``: wait for them)."""
        with self._lock:
            threads = [t for t in self._threads if t.ident not in self._abandoned]
        for _ in threads:
            self._queue.put(_STOP)
        if wait:
            for thread in threads:
                thread.join()

    def _serve(self) -> None:
        try:
            self._serve_calls()
        finally:
            for hook in (self._on_idle, self._on_exit):
                if hook is not None:
                    _run_hook(hook)

    def _idle_hook(self) -> None:
        assert self._on_idle is not None
        _run_hook(self._on_idle)

    def _serve_calls(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                if self._on_idle is not None:
                    self._idle_hook()  # before waiting: nothing is held while there is nothing to do
                item = self._queue.get()
            if item is _STOP:
                return
            call, args, weight = item
            ident = threading.get_ident()
            if weight != 1:
                with self._lock:
                    self._weights[ident] = weight
            try:
                found = bool(call(*args))
            except BaseException:  # a database error outside a handler: log, keep the thread
                log.exception("job slot failed")
                found = False
            with self._lock:
                if ident in self._abandoned:
                    return  # counted as finished when it was given up on; a new thread serves
                self._active -= self._weights.pop(ident, 1) if weight != 1 else 1
                active = self._active
                if found:
                    self._ran += 1
                else:
                    self._empty += 1
                if active <= 0:  # wait_idle waits for nothing in flight, nothing else
                    self._idle.notify_all()
            self._on_done(active)


def _run_hook(hook: Callable[[], None]) -> None:
    try:
        hook()
    except Exception:
        log.exception("job slot's hook %r failed", hook)
