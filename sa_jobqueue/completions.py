"""CompletionBuffer: completions of jobs that need no transaction of their own.

A handler that takes no session writes nothing in the job's transaction, so
its completion need not be a transaction of its own either. The worker
buffers such completions and writes them as one fenced statement per flush
(:meth:`JobRepository.complete_many`): when ``max_size`` are waiting (the
slot thread that fills the buffer writes it, so the worker's loop keeps
claiming meanwhile), or ``max_delay`` after the first one (the loop writes
it), and always before the worker stops. A job
counts as completed only once its flush has committed; until then it stays
in the worker's running set, so its lease is still extended.
"""

from __future__ import annotations

import threading
import time
from typing import Any

Entry = tuple[Any, Any, float]  # (repository, job, the handler's run time in seconds)


class CompletionBuffer:
    """Thread-safe buffer of (repository, job) awaiting their fenced completion."""

    def __init__(self, *, max_size: int = 100, max_delay: float = 0.005) -> None:
        self.max_size = max_size
        self.max_delay = max_delay
        self._lock = threading.Lock()
        self._entries: list[Entry] = []
        self._first_at = 0.0

    def add(self, repo: Any, job: Any, duration: float) -> bool:
        """Buffer a completion; return True when the buffer is now full (the caller flushes it)."""
        with self._lock:
            if not self._entries:
                self._first_at = time.monotonic()
            self._entries.append((repo, job, duration))
            return len(self._entries) >= self.max_size

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def deadline(self) -> float | None:
        """When the oldest waiting completion must be flushed (monotonic), or None."""
        with self._lock:
            return self._first_at + self.max_delay if self._entries else None

    def due(self) -> bool:
        with self._lock:
            if not self._entries:
                return False
            return len(self._entries) >= self.max_size or time.monotonic() >= self._first_at + self.max_delay

    def take(self) -> list[Entry]:
        with self._lock:
            entries, self._entries = self._entries, []
            return entries

    def put_back(self, entries: list[Entry]) -> None:
        """Return entries whose flush failed; they are flushed again next time."""
        with self._lock:
            if not self._entries:
                self._first_at = time.monotonic()
            self._entries[:0] = entries
