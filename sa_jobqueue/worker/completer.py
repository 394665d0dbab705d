"""Completer: completions of jobs that need no transaction of their own.

A handler that takes no session writes nothing in the job's transaction, so
its completion need not be a transaction of its own either. The completer
buffers such completions and writes them as one fenced statement per table
(:meth:`JobRepository.complete_many`): when ``max_size`` are waiting (the
slot thread that fills the buffer writes it, so the worker's loop keeps
claiming meanwhile; in the asyncio worker, the loop), ``max_delay`` after the first one (the loop writes
it), and always before the worker stops.

In the thread worker each write is one statement on a connection of the
worker's own autocommit engine, without a session around it; a connection
that an error made unusable is discarded, not given back to the pool.

A job counts as completed only once its flush has committed; until then it
stays held, so its lease is still extended. A flush that fails keeps its
completions and waits before the next try, doubling the wait from
``retry_delay`` up to ``max_retry_delay``, with one log line per try: a
failing write (a role that may not DELETE, a server gone) neither spins
nor loses a completion. What cannot be written by the time the worker
stops is logged; those jobs run again after their lease expires (at least
once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from .. import signals
from ..connections import send_on_own
from .books import Books

log = logging.getLogger("sa_jobqueue.worker")

Entry = tuple[Any, Any, float]  # (repository, job, the handler's run time in seconds)


class Completer:
    """Thread-safe buffer of completions and their fenced, batched writes."""

    def __init__(
        self,
        books: Books,
        control: Callable[[], AbstractContextManager[Session]],
        *,
        sender: Any = None,
        name: str = "worker",
        max_size: int = 100,
        max_delay: float = 0.005,
        retry_delay: float = 0.1,
        max_retry_delay: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        write_when_full: bool = True,
        engine: Engine | None = None,
    ) -> None:
        self.books = books
        # The worker's own autocommit engine (the thread worker's): each write is one statement
        # on a connection of it, without a session around it. None: a session of ``control`` each.
        self.engine = engine
        # False (the asyncio worker): add() never writes; the loop writes
        # when due() says so, since add() runs outside SQLAlchemy's greenlet.
        self.write_when_full = write_when_full
        self.control = control
        self.sender = sender
        self.name = name
        self.max_size = max_size
        self.max_delay = max_delay
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self.clock = clock
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._entries: list[Entry] = []
        self._first_at = 0.0
        self._failures = 0  # consecutive failed flushes
        self._retry_at = 0.0

    def add(self, repo: Any, job: Any, duration: float) -> None:
        """Buffer a completion; write the buffer at once when it is full."""
        with self._lock:
            if not self._entries:
                self._first_at = self.clock()
            self._entries.append((repo, job, duration))
            full = len(self._entries) >= self.max_size and not self._failures
        if full and self.write_when_full:
            self.flush()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def deadline(self) -> float | None:
        """When the buffer must next be written (monotonic), or None when empty."""
        with self._lock:
            if not self._entries:
                return None
            if self._failures:
                return self._retry_at
            return self._first_at + self.max_delay

    def due(self, now: float) -> bool:
        with self._lock:
            if not self._entries:
                return False
            if self._failures:
                return now >= self._retry_at
            return len(self._entries) >= self.max_size or now >= self._first_at + self.max_delay

    def flush(self) -> None:
        """Write the buffered completions, one fenced statement per table."""
        with self._flushing:  # one flush at a time: a failing write is retried by one thread
            with self._lock:
                entries, self._entries = self._entries, []
            if entries:
                self._write(entries)

    def final_flush(self, *, until: float) -> None:
        """Before the worker stops: retry a failing write until ``until`` (monotonic)."""
        while True:
            self.flush()
            wait = (self.deadline() or until) - self.clock()
            if not len(self) or self.clock() + max(wait, 0) >= until:
                break
            time.sleep(max(wait, 0.0))
        if len(self):
            log.error("worker %s: %s completions could not be written; their leases will expire and the "
                      "jobs run again", self.name, len(self))

    def _write(self, entries: list[Entry]) -> None:
        failed: list[Entry] = []
        for repo in {id(entry[0]): entry[0] for entry in entries}.values():
            mine = [entry for entry in entries if entry[0] is repo]
            try:
                done = self._complete(repo, [job for _, job, _ in mine])
            except Exception as exc:
                failed += mine
                self._failed(len(mine), exc)
                continue
            self._written(mine, done)
        with self._lock:
            if failed:
                self._entries[:0] = failed
            elif self._failures:
                log.info("worker %s: completions are written again", self.name)
                self._failures = 0

    def _complete(self, repo: Any, jobs: list[Any]) -> set[int]:
        """One fenced statement for ``jobs`` of ``repo``'s table; the ids it finished."""
        if self.engine is None:
            with self.control() as session:
                return repo.complete_many(session, jobs)  # type: ignore[no-any-return]
        with self.engine.connect() as connection:
            return send_on_own(connection, lambda own: repo.completions.many_on(own, jobs))

    def _failed(self, count: int, exc: Exception) -> None:
        with self._lock:
            self._failures += 1
            wait = min(self.max_retry_delay, self.retry_delay * 2 ** (self._failures - 1))
            self._retry_at = self.clock() + wait
        log.error("worker %s: writing %s completions failed (try %s), next try in %.1f s: %r",
                  self.name, count, self._failures, wait, exc)

    def _written(self, entries: list[Entry], done: set[int]) -> None:
        # The books once per write, not once per job: a write holds up to max_size completions.
        books = self.books
        books.release_all([job for _, job, _ in entries])
        completed = [entry for entry in entries if entry[1].id in done]
        books.count("completed", len(completed))
        books.tally_all([job for _, job, _ in completed], "completed")
        if signals.job_succeeded.receivers:
            for _, job, duration in completed:
                signals.send(signals.job_succeeded, self.sender, job=job, duration=duration)
        if len(completed) < len(entries):
            for _, job, _ in entries:
                if job.id not in done:
                    log.warning("worker %s: job %s finished after its lease was lost", self.name, job.id)
            books.count("lost", len(entries) - len(completed))
