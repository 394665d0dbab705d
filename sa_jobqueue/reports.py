"""What the verbs report: the results of a reap, of a lease extension, and stats.

Plain frozen dataclasses, returned by :class:`~sa_jobqueue.JobRepository`
(``reap``, ``extend_leases``, ``stats``); no behaviour, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class ReapResult:
    """What one reap did: jobs sent back to pending, jobs sent to dead, and
    jobs cancelled (a cancel was requested while they ran)."""

    requeued: int
    dead: int
    cancelled: int = 0


@dataclass(frozen=True)
class LeaseReport:
    """What one :meth:`JobRepository.extend_leases` found: the ids of the jobs
    still owned (their leases extended), and those of them whose cancel was
    requested (a subset of ``owned``)."""

    owned: set[int]
    cancel_requested: set[int]


@dataclass(frozen=True)
class QueueStats:
    """Jobs of one queue in one status. ``oldest_runnable_age`` is set for
    ``pending`` rows: how long the oldest runnable job has been waiting."""

    queue: str
    status: str
    count: int
    oldest_runnable_age: timedelta | None
