"""RunningJobs: the jobs whose handlers a worker runs right now, for its presence.

Every place a worker runs a job's handler (both drivers, both modes, grouped
commits) enters :meth:`WorkerContext.running_job`, which records the job here
for the duration. The presence beat (:mod:`sa_jobqueue.worker.presence_beat`)
writes :meth:`RunningJobs.described` to the worker's row: what each job is,
since when, and its last reported progress. A dict operation per job, no
statement.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = ["MAX_DESCRIBED", "RunningJobs"]

# The most running jobs one presence row lists (a worker of a large concurrency
# lists its longest running; the row stays small).
MAX_DESCRIBED = 100


class RunningJobs:
    """The handlers running in one worker, by job; safe across its threads."""

    def __init__(self) -> None:
        # id(job) -> [job, wall-clock start, entries]: a job entered again
        # (its failure recorded in the same context) keeps its start. No lock:
        # one job is entered by one thread at a time, and each step is one
        # dict operation, atomic in CPython; :meth:`described` copies first.
        self._jobs: dict[int, list[Any]] = {}

    def running(self, job: Any) -> _Running:
        """A context manager: ``job``'s handler runs in the block."""
        return _Running(self._jobs, job)

    def __len__(self) -> int:
        return len(self._jobs)

    def described(self) -> list[dict[str, Any]]:
        """The running jobs, longest running first, as JSON for the presence row."""
        entries = sorted(((job, started) for job, started, _ in list(self._jobs.values())), key=lambda e: e[1])
        return [{
            "table": job.__table__.name,
            "id": job.id,
            "task": job.task,
            "queue": job.queue,
            "attempt": job.attempts,
            "since": _iso(started),
            # As report_progress stored it (checked there): {"fraction", "message"} or None.
            "progress": getattr(job, "progress", None),
        } for job, started in entries[:MAX_DESCRIBED]]


class _Running:
    """One entry of :class:`RunningJobs` for the length of a block (a class: it runs around every job)."""

    __slots__ = ("_jobs", "_job")

    def __init__(self, jobs: dict[int, list[Any]], job: Any) -> None:
        self._jobs, self._job = jobs, job

    def __enter__(self) -> None:
        entry = self._jobs.get(id(self._job))
        if entry is None:
            self._jobs[id(self._job)] = [self._job, time.time(), 1]
        else:
            entry[2] += 1

    def __exit__(self, *exc: object) -> None:
        key = id(self._job)
        entry = self._jobs[key]
        entry[2] -= 1
        if not entry[2]:
            del self._jobs[key]


def _iso(epoch: float) -> str:
    return (datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=epoch)).isoformat()
