"""WorkerFace: what callers read of a worker, thread or asyncio alike.

Both drivers keep their checked options in ``options`` and their counts in
``_books``; this base class turns them into the read-only attributes the
command line, the Flask integration and users' code read.
"""

from __future__ import annotations

from datetime import timedelta

from .books import Books, WorkerResult
from .options import Mode, WorkerOptions


class WorkerFace:
    """The read-only face of a worker: :attr:`result` and its options."""

    options: WorkerOptions
    _books: Books

    @property
    def result(self) -> WorkerResult:
        """What this worker did so far (counted once each outcome committed)."""
        return self._books.result

    @property
    def queues(self) -> list[str]:
        return self.options.queues

    @property
    def concurrency(self) -> int:
        return self.options.concurrency

    @property
    def mode(self) -> Mode:
        return self.options.mode

    @property
    def lease(self) -> timedelta:
        return self.options.lease

    @property
    def batch_size(self) -> int | None:
        return self.options.batch_size

    @property
    def poll_interval(self) -> float:
        return self.options.poll_interval
