"""RunningJobs: the jobs whose handlers a worker runs right now, for its presence.

Every place a worker runs a job's handler (both drivers, both modes, grouped
commits) enters :meth:`WorkerContext.running_job`, which records the job here
for the duration. The presence beat (:mod:`sa_jobqueue.worker.presence_beat`)
writes :meth:`RunningJobs.described` to the worker's row: what each job is,
since when, and its last reported progress. A dict operation per job, no
statement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = ["MAX_DESCRIBED", "RunningJobs"]

# The most running jobs one presence row lists (a worker of a large concurrency
# lists its longest running; the row stays small).
MAX_DESCRIBED = 100


class RunningJobs:
    """Thread-safe: the handlers running in one worker, by job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(job) -> [job, wall-clock start, entries]: a job entered again
        # (its failure recorded in the same context) keeps its start.
        self._jobs: dict[int, list[Any]] = {}

    @contextmanager
    def running(self, job: Any) -> Iterator[None]:
        key = id(job)
        with self._lock:
            entry = self._jobs.get(key)
            if entry is None:
                self._jobs[key] = [job, time.time(), 1]
            else:
                entry[2] += 1
        try:
            yield
        finally:
            with self._lock:
                entry = self._jobs[key]
                entry[2] -= 1
                if not entry[2]:
                    del self._jobs[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def described(self) -> list[dict[str, Any]]:
        """The running jobs, longest running first, as JSON for the presence row."""
        with self._lock:
            entries = sorted(((job, started) for job, started, _ in self._jobs.values()), key=lambda e: e[1])
        described = []
        for job, started in entries[:MAX_DESCRIBED]:
            described.append({
                "table": job.__table__.name,
                "id": job.id,
                "task": job.task,
                "queue": job.queue,
                "attempt": job.attempts,
                "since": _iso(started),
                # As report_progress stored it (checked there): {"fraction", "message"} or None.
                "progress": getattr(job, "progress", None),
            })
        return described


def _iso(epoch: float) -> str:
    return (datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=epoch)).isoformat()
