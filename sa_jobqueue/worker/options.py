"""WorkerOptions: every option of a worker, checked once, in one place.

:class:`~sa_jobqueue.Worker` takes its options as keywords and builds one
of these; the pieces of the worker (the pacer, the modes, the maintenance
duties) read it and never check an option again. A bad option raises
:class:`~sa_jobqueue.InvalidArgumentError` naming it, before anything
connects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from ..checks import (
    check_duration,
    check_interval,
    check_lease,
    check_poll_interval,
    check_queues,
    check_timeout,
    check_worker_name,
    positive_int,
)
from ..errors import InvalidArgumentError

Mode = Literal["lease", "transaction"]
DEFAULT_TRANSACTION_BATCH = 10
# Claims a lease-mode worker may have in flight at once.
CLAIMERS = 2
DEFAULT_STALL_TIMEOUT = timedelta(seconds=10)
# Oban's and Sidekiq's default grace at shutdown is about this (Sidekiq: 25 s).
DEFAULT_SHUTDOWN_TIMEOUT = timedelta(seconds=30)


@dataclass(frozen=True)
class WorkerOptions:
    """The checked options of one worker (see :class:`~sa_jobqueue.Worker`)."""

    queues: list[str]
    concurrency: int
    mode: Mode
    lease: timedelta
    heartbeat_interval: float
    reap_interval: float
    poll_interval: float
    listen: bool
    batch_size: int | None
    name: str | None
    stall_timeout: timedelta | None
    periodic_interval: float
    shutdown_timeout: timedelta
    job_timeout: timedelta | None
    max_stuck_slots: int

    @property
    def capacity(self) -> int:
        """How many claimed jobs the worker may hold at once.

        With a batch_size, lease mode claims ahead of its threads and holds up
        to CLAIMERS + 1 batches: one running, the others ready or travelling,
        so a batch is always queued while a claim is on its way (a single
        batch would leave the threads idle for the claim's round trip each
        time it drains). Claimed jobs wait with their leases extended.
        """
        if self.mode == "lease" and self.batch_size:
            return max(self.concurrency, (CLAIMERS + 1) * self.batch_size)
        return self.concurrency

    @classmethod
    def check(
        cls,
        *,
        queues: str | Sequence[str],
        concurrency: int,
        mode: object,
        lease: timedelta,
        heartbeat_interval: timedelta | None,
        reap_interval: timedelta | None,
        poll_interval: float,
        listen: bool,
        batch_size: int | None,
        name: str | None,
        stall_timeout: timedelta | None,
        periodic_interval: float,
        shutdown_timeout: timedelta | float,
        job_timeout: timedelta | float | None,
        max_stuck_slots: int | None,
    ) -> WorkerOptions:
        """Check each option; raise :class:`InvalidArgumentError` naming the first bad one."""
        concurrency = positive_int("concurrency", concurrency)
        if mode not in ("lease", "transaction"):
            raise InvalidArgumentError("mode", f"must be 'lease' or 'transaction', got {mode!r}")
        lease = check_lease("lease", lease)
        if heartbeat_interval is not None:
            check_duration("heartbeat_interval", heartbeat_interval)
        if reap_interval is not None:
            check_duration("reap_interval", reap_interval)
        if not isinstance(listen, bool):
            raise InvalidArgumentError("listen", f"must be a bool, got {listen!r}")
        if batch_size is not None:
            positive_int("batch_size", batch_size)
        if stall_timeout is not None:
            stall_timeout = check_lease("stall_timeout", stall_timeout)
        stuck = concurrency if max_stuck_slots is None else positive_int("max_stuck_slots", max_stuck_slots)
        return cls(
            queues=check_queues(queues),
            concurrency=concurrency,
            mode=mode,
            lease=lease,
            heartbeat_interval=(heartbeat_interval or lease / 3).total_seconds(),
            reap_interval=(reap_interval or lease / 2).total_seconds(),
            poll_interval=check_poll_interval(poll_interval),
            listen=listen,
            batch_size=batch_size or (DEFAULT_TRANSACTION_BATCH if mode == "transaction" else None),
            name=check_worker_name("name", name),
            stall_timeout=stall_timeout,
            periodic_interval=check_interval("periodic_interval", periodic_interval),
            shutdown_timeout=_check_shutdown_timeout(shutdown_timeout),
            job_timeout=None if job_timeout is None else check_timeout("job_timeout", job_timeout),
            max_stuck_slots=stuck,
        )


def _check_shutdown_timeout(value: object) -> timedelta:
    """Zero is allowed: return at once, leaving running jobs to their lease."""
    if (value == 0 or value == timedelta(0)) and not isinstance(value, bool):
        return timedelta(0)
    return check_timeout("shutdown_timeout", value)
