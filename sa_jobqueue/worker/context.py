"""WorkerContext: what the pieces of a worker share, passed to each explicitly.

The modes, the executor and the maintenance duties get this object instead
of the worker itself, so none of them reaches into another's private state.
It holds no thread and starts nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, Table
from sqlalchemy.orm import Session, sessionmaker

from ..inflight import NOT_WATCHED, ConnectionWatch
from ..logs import job_context
from .job_sessions import READ_COMMITTED, JobSessions, read_committed_connection
from .running import RunningJobs

if TYPE_CHECKING:
    from ..runnable import Tasks
    from .books import Books
    from .completer import Completer
    from .options import WorkerOptions
    from .pace import Pacer

__all__ = ["READ_COMMITTED", "Control", "WorkerContext"]


class Control:
    """Transactions for the worker's own one-statement writes: autocommit on
    the worker's own engine when it has one, else a READ COMMITTED
    transaction of the app's sessionmaker on the connection of each job
    table (``tables``), which works with per-table ``binds`` too."""

    def __init__(self, own: sessionmaker[Session] | None, sessions: sessionmaker[Session],
                 tables: Sequence[Table] = ()) -> None:
        self.own = own
        self.sessions = sessions
        self.tables = list(tables)

    @property
    def engine(self) -> Engine | None:
        """The worker's own engine (autocommit), or None when it has none."""
        bind = self.own.kw.get("bind") if self.own is not None else None
        return bind if isinstance(bind, Engine) else None

    @contextmanager
    def __call__(self) -> Iterator[Session]:
        with (self.own or self.sessions)() as session, session.begin():
            if self.own is None:
                read_committed_connection(session, self.tables)
            yield session


@dataclass
class WorkerContext:
    """One worker's shared parts. ``sessions`` is the application's
    sessionmaker, ``job_sessions`` the jobs' sessions made from it (on the
    connections their slots hold); ``control`` the worker's own transactions, for its
    one-statement writes (claims, heartbeats, reaps, batched completions,
    failures recorded from outside a job's session)."""

    options: WorkerOptions
    name: str
    tasks: Tasks
    repositories: list[Any]
    sessions: sessionmaker[Session]
    control: Control
    books: Books
    completer: Completer
    pacer: Pacer
    sender: Any  # the sender of signals: the Worker
    job_sessions: JobSessions
    stopping: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)
    sessions_open: int = 0  # job sessions this worker holds right now
    # Watches a job's connection while the job holds it (None: no watchdog).
    watch_connection: Callable[[Any], ConnectionWatch] | None = None
    running: RunningJobs = field(default_factory=RunningJobs)
    # Takes the loop's step in the calling thread, where the driver allows it
    # (True); False: the caller wakes the loop's thread to take it.
    step_now: Callable[[bool], bool] = field(default=lambda notified: False)
    # The paused queues of each job table, by table name, as of the last read
    # (sa_jobqueue.worker.presence_beat.PauseWatch); claims leave them out.
    paused: dict[str, frozenset[str]] = field(default_factory=dict)
    _turn: int = 0
    _hand_backs: list[Any] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def autocommit_control(self) -> bool:
        """Whether the worker's own statements run on its own autocommit engine."""
        return self.control.own is not None

    def rotation(self) -> list[Any]:
        """The repositories, starting one further each call, so that a busy
        first table cannot starve the others."""
        with self._lock:
            self._turn = (self._turn + 1) % len(self.repositories)
            turn = self._turn
        return self.repositories[turn:] + self.repositories[:turn]

    def running_job(self, job: Any) -> _RunningJob:
        """A context manager: the block runs ``job``'s handler (or records its
        outcome); the job is this thread's current job for logging, and listed as running."""
        return _RunningJob(job_context(job), self.running.running(job))

    def queues_for(self, repo: Any) -> list[str]:
        """The worker's queues of ``repo``'s table that are not paused, in their order."""
        paused = self.paused.get(repo.table.name)
        return claimable(self.options.queues, paused) if paused else self.options.queues

    def session_opened(self, delta: int) -> None:
        with self._lock:
            self.sessions_open += delta

    def hand_back_later(self, held: list[Any]) -> None:
        """Jobs whose hand back failed: the loop tries again (:meth:`take_hand_backs`)."""
        with self._lock:
            self._hand_backs.extend(held)

    def take_hand_backs(self) -> list[Any]:
        with self._lock:
            held, self._hand_backs = self._hand_backs, []
        return held

    def watch(self, connection: Any) -> ConnectionWatch:
        """The watchdog's watch of a job's connection, held until released."""
        return NOT_WATCHED if self.watch_connection is None else self.watch_connection(connection)

    def back_off(self) -> None:
        """Something failed that the next claim would meet again: wait a poll interval."""
        self.pacer.back_off(time.monotonic())


def claimable(queues: Sequence[str], paused: frozenset[str]) -> list[str]:
    """The queues a worker claims from: its ``queues`` less the ``paused`` ones (possibly none)."""
    return [queue for queue in queues if queue not in paused]


class _RunningJob:
    """Both context managers of :meth:`WorkerContext.running_job` in one (a class: it runs around every job)."""

    __slots__ = ("_logged", "_listed")

    def __init__(self, logged: Any, listed: Any) -> None:
        self._logged, self._listed = logged, listed

    def __enter__(self) -> None:
        self._logged.__enter__()
        self._listed.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._listed.__exit__(*exc)
        self._logged.__exit__(*exc)
