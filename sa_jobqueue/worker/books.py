"""Books: what a worker holds and what it did, shared by its threads.

* ``result``: the jobs completed, retried, sent to dead, cancelled, lost
  and handed back, counted only once the transaction that records each
  outcome has committed, so a result never reports work that was rolled
  back.
* The held jobs (lease mode): each claimed job from its claim until its
  finishing statement, with when it started, its deadline, the backend
  running its session and whether a cancel was asked for. The heartbeat
  extends the leases of these jobs; a job leaves before its finishing
  statement is sent, so a heartbeat never mistakes a job completed a moment
  ago for a lost one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class WorkerResult:
    """What a worker did: jobs completed, retried, sent to dead, cancelled
    while running, lost (finished too late: the lease had expired and the job
    was reaped), and handed back unstarted (at shutdown, or when the job's
    session could not connect; their attempt was not counted)."""

    completed: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0
    cancelled: int = 0
    handed_back: int = 0


OUTCOMES = frozenset(f.name for f in fields(WorkerResult))


@dataclass
class Held:
    """A claimed job the worker holds (lease mode)."""

    repo: Any
    job: Any
    started: float | None = None  # monotonic, once its handler started
    deadline: float | None = None  # monotonic, once started, when the task has a timeout
    backend_pid: int | None = None  # of the job's session, read in the thread that owns it
    cancel_requested: bool = False
    progress_sent: Any = None  # the job's progress as the last heartbeat wrote it (sa_jobqueue.progress)
    timed_out: bool = False  # the deadline passed: the failure is recorded, the late return fenced
    thread: int | None = None  # the slot thread running it, once started (or connecting)
    connecting_since: float | None = None  # monotonic, while its session waits for a connection
    gave_up: bool = False  # its session stalled connecting: handed back, its thread replaced
    finished: bool = False  # its slot thread is done with it
    # A group's first job (grouped commits): the others of its group, handed
    # back with it when the group's session stalls connecting.
    followers: tuple[Held, ...] = ()
    # The asyncio worker: the task running its coroutine handler, while the
    # handler runs (cancelled at its deadline, on a cancel request, at stop).
    task: Any = None
    interrupted: bool = False  # the asyncio worker stopped while it ran: its coroutine was cancelled
    # Held by the slot thread while it ends the job's session, and by the
    # watch while it cancels the session's statement: the backend is the
    # job's for as long as the lock is held.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def cancelled_by_worker(self) -> bool:
        """Whether the worker ended its run from outside (a deadline, a cancel
        request, a stop's interrupt): in the asyncio worker, a CancelledError
        of the job's coroutine is then the worker's own, not its caller's."""
        return self.timed_out or self.cancel_requested or self.interrupted


class Books:
    """Thread-safe counts and held jobs of one worker."""

    def __init__(self) -> None:
        self.result = WorkerResult()
        self._lock = threading.Lock()
        self._held: dict[Any, Held] = {}  # by lock token
        # (table, queue) -> [completed, failed] since the presence beat last took them (sa_jobqueue.throughput).
        self._tally: dict[tuple[str, str], list[int]] = {}

    def tally(self, job: Any, outcome: str) -> None:
        """The outcome of ``job`` committed: count it for the throughput, as ``completed`` or
        ``failed`` (a retry, a death or a timeout)."""
        self.tally_all([job], outcome)

    def tally_all(self, jobs: list[Any], outcome: str) -> None:
        """:meth:`tally` for each of ``jobs``, under one hold of the lock (a batch's completions)."""
        completed = outcome == "completed"
        with self._lock:
            for job in jobs:
                key = (job.__table__.name, job.queue)
                counts = self._tally.get(key)
                if counts is None:
                    counts = self._tally[key] = [0, 0]
                counts[0 if completed else 1] += 1

    def take_tally(self) -> dict[tuple[str, str], list[int]]:
        """The counts since the last take, and start again from zero."""
        with self._lock:
            taken, self._tally = self._tally, {}
        return taken

    def give_back_tally(self, taken: dict[tuple[str, str], list[int]]) -> None:
        """Counts taken but not written (the write failed): the next take has them again."""
        with self._lock:
            for key, (completed, failed) in taken.items():
                counts = self._tally.setdefault(key, [0, 0])
                counts[0] += completed
                counts[1] += failed

    def count(self, outcome: str, n: int = 1) -> None:
        """Count ``n`` jobs of ``outcome`` (a :class:`WorkerResult` field; a
        failure's new status 'pending' counts as retried)."""
        name = "retried" if outcome == "pending" else outcome
        if name not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        with self._lock:
            setattr(self.result, name, getattr(self.result, name) + n)

    def hold(self, repo: Any, job: Any) -> Held:
        return self.hold_all(repo, [job])[0]

    def hold_all(self, repo: Any, jobs: list[Any]) -> list[Held]:
        """:meth:`hold` for each of ``jobs`` (one claim's), under one hold of the lock."""
        held = [Held(repo, job) for job in jobs]
        with self._lock:
            for h in held:
                self._held[h.job.lock_token] = h
        return held

    def keep(self, held: Held) -> None:
        """Hold ``held`` again (released for a finishing statement that rolled back)."""
        with self._lock:
            self._held[held.job.lock_token] = held

    def release(self, job: Any) -> Held | None:
        """Stop extending ``job``'s lease: its finishing statement follows."""
        with self._lock:
            return self._held.pop(job.lock_token, None)

    def release_all(self, jobs: list[Any]) -> None:
        """:meth:`release` for each of ``jobs`` (a batch's), under one hold of the lock."""
        with self._lock:
            for job in jobs:
                self._held.pop(job.lock_token, None)

    def get(self, job: Any) -> Held | None:
        with self._lock:
            return self._held.get(job.lock_token)

    def holds(self, job: Any) -> bool:
        with self._lock:
            return job.lock_token in self._held

    def held(self) -> list[Held]:
        """A snapshot of the held jobs."""
        with self._lock:
            return list(self._held.values())

    def by_id(self, job_id: int) -> Held | None:
        with self._lock:
            return next((h for h in self._held.values() if h.job.id == job_id), None)
