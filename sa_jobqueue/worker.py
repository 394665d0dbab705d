"""Worker: claim jobs, run each with a fresh session, finish them.

::

    worker = Worker(engine, emails, tasks, queues=["signup"], concurrency=4)
    worker.run()                      # until SIGINT/SIGTERM
    worker.run(until_empty=True)      # scripts and tests: stop when idle

Two modes (see docs/concepts.md):

* ``lease`` (default): the claim commits at once; each job then runs in its
  own session and transaction, where the handler's writes and the fenced
  completion commit together. The worker extends the leases of its running
  jobs (heartbeat) and reaps expired leases of crashed workers.
* ``transaction``: claim, handler and completion share one transaction that
  holds the row lock; the handler runs in a SAVEPOINT so that its failure is
  rolled back and still recorded.

A worker with concurrency C uses at most C + 1 connections: one per running
job and one for claims, heartbeats and reaping.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from .errors import InvalidArgumentError, JobLostError, RetryJob
from .mixin import DEAD
from .registry import Task, TaskRegistry
from .repository import DEFAULT_LEASE, JobRepository, _queues, default_worker_name

log = logging.getLogger("sa_jobqueue.worker")

Mode = Literal["lease", "transaction"]
_ERROR_LIMIT = 4000
_READ_COMMITTED = {"isolation_level": "READ COMMITTED"}


@dataclass
class WorkerResult:
    """What a worker did: jobs completed, retried, sent to dead, and lost
    (finished too late: the lease had expired and the job was reaped)."""

    completed: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0


def describe_error(exc: BaseException) -> str:
    """The text kept in ``last_error``: the exception and the end of its traceback."""
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= _ERROR_LIMIT else "…" + text[-_ERROR_LIMIT:]


class Worker:
    """Runs jobs of one or more job tables with a pool of threads."""

    def __init__(
        self,
        bind: Engine | sessionmaker[Session],
        repositories: JobRepository[Any] | Sequence[JobRepository[Any]],
        tasks: TaskRegistry,
        *,
        queues: str | Sequence[str] = "default",
        concurrency: int = 4,
        mode: Mode = "lease",
        lease: timedelta = DEFAULT_LEASE,
        heartbeat_interval: timedelta | None = None,
        reap_interval: timedelta | None = None,
        poll_interval: float = 1.0,
        name: str | None = None,
    ) -> None:
        if isinstance(bind, Engine):
            self._sessions: sessionmaker[Session] = sessionmaker(bind, expire_on_commit=False)
        elif isinstance(bind, sessionmaker):
            self._sessions = bind
        else:
            raise InvalidArgumentError("bind", "must be an Engine or a sessionmaker")
        repos = [repositories] if isinstance(repositories, JobRepository) else list(repositories)
        if not repos or not all(isinstance(r, JobRepository) for r in repos):
            raise InvalidArgumentError("repositories", "give one or more JobRepository")
        if not isinstance(tasks, TaskRegistry):
            raise InvalidArgumentError("tasks", "must be a TaskRegistry")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidArgumentError("concurrency", f"must be a positive integer, got {concurrency!r}")
        if mode not in ("lease", "transaction"):
            raise InvalidArgumentError("mode", f"must be 'lease' or 'transaction', got {mode!r}")
        if not isinstance(lease, timedelta) or lease <= timedelta(0):
            raise InvalidArgumentError("lease", "must be a positive timedelta")
        if not poll_interval > 0:
            raise InvalidArgumentError("poll_interval", "must be a positive number of seconds")
        self.repositories = repos
        self.tasks = tasks
        self.queues = _queues(queues)
        self.concurrency = concurrency
        self.mode: Mode = mode
        self.lease = lease
        self.heartbeat_interval = (heartbeat_interval or lease / 3).total_seconds()
        self.reap_interval = (reap_interval or lease / 2).total_seconds()
        self.poll_interval = poll_interval
        self.name = name or default_worker_name()
        self.result = WorkerResult()
        self._task_limits = {t.name: t.max_attempts for t in tasks if t.max_attempts is not None}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._turn = 0
        # Jobs whose lease this worker extends, by lock token (lease mode). A
        # job leaves before its finishing statement, so a heartbeat never
        # mistakes a job completed a moment ago for a lost one.
        self._running: dict[Any, tuple[JobRepository[Any], Any]] = {}

    # -- public ----------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; :meth:`run` returns once the running jobs finish."""
        self._stopping.set()

    def run(self, *, until_empty: bool = False) -> WorkerResult:
        """Run until :meth:`stop`, SIGINT or SIGTERM (or, with ``until_empty``,
        until nothing is runnable and nothing is running). Jobs in flight are
        always finished before it returns."""
        restore = self._install_signal_handlers()
        try:
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="sa_jobqueue") as pool:
                self._loop(pool, until_empty)
        finally:
            restore()
        return self.result

    # -- the loop --------------------------------------------------------

    def _loop(self, pool: ThreadPoolExecutor, until_empty: bool) -> None:
        inflight: set[Future[Any]] = set()
        idle_wait = 0.0
        next_reap = time.monotonic()
        next_heartbeat = next_reap if self.mode == "lease" else float("inf")
        found = True  # did the latest claim find work?
        while not self._stopping.is_set():
            now = time.monotonic()
            if now >= next_reap:
                self._reap()
                next_reap = now + self.reap_interval
            if self.mode == "lease" and now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + self.heartbeat_interval
            free = self.concurrency - len(inflight)
            if self.mode == "lease":
                claimed = self._claim(free) if free > 0 else []
                for repo, job in claimed:
                    with self._lock:
                        self._running[job.lock_token] = (repo, job)
                    inflight.add(pool.submit(self._run_leased, repo, job))
                if free > 0:
                    found = bool(claimed)
            else:
                # Each slot claims in its own transaction. While idle, probe
                # with one slot at a time rather than C empty transactions.
                probes = free if found else (0 if inflight else 1)
                for _ in range(probes):
                    inflight.add(pool.submit(self._run_in_transaction))
            if inflight and (self.mode == "transaction" or not found or free <= len(claimed)):
                done, _ = wait(
                    inflight, timeout=self._until(next_heartbeat, next_reap), return_when=FIRST_COMPLETED
                )
                ran, empty = self._collect(done, inflight)
                if self.mode == "transaction" and (ran or empty):
                    found = ran > 0
            if found:
                idle_wait = 0.0
            elif not inflight:
                if until_empty:
                    break
                idle_wait = self._next_idle_wait(idle_wait)
                self._stopping.wait(min(idle_wait, self._until(next_heartbeat, next_reap) or idle_wait))
        wait(inflight)
        self._collect(set(inflight), inflight)

    def _until(self, *deadlines: float) -> float:
        return max(0.0, min(min(deadlines) - time.monotonic(), self.poll_interval))

    def _next_idle_wait(self, previous: float) -> float:
        # Exponential backoff from 50 ms to poll_interval, ±25% jitter so that
        # many idle workers do not poll in step.
        base = min(self.poll_interval, max(0.05, previous * 2))
        return base * random.uniform(0.75, 1.25)

    def _collect(self, done: set[Future[Any]], inflight: set[Future[Any]]) -> tuple[int, int]:
        """Retire finished futures; return how many ran a job and how many found none."""
        ran = empty = 0
        for future in done:
            inflight.discard(future)
            try:
                if future.result():
                    ran += 1
                else:
                    empty += 1
            except Exception:  # a database error outside a handler: keep going
                log.exception("worker %s: job slot failed", self.name)
                empty += 1
        return ran, empty

    # -- statements in short transactions of the control connection -------

    def _session(self) -> Session:
        return self._sessions()

    def _claim(self, free: int) -> list[tuple[JobRepository[Any], Any]]:
        claimed: list[tuple[JobRepository[Any], Any]] = []
        try:
            with self._session() as session:
                for repo in self._rotation():
                    if free <= 0:
                        break
                    with session.begin():
                        session.connection(execution_options=_READ_COMMITTED)
                        jobs = repo.claim(
                            session, queues=self.queues, limit=free, worker=self.name, lease=self.lease
                        )
                        # Detach before commit so that expire_on_commit cannot
                        # unload them: the handler reads them in another session.
                        session.expunge_all()
                    claimed.extend((repo, job) for job in jobs)
                    free -= len(jobs)
        except Exception:
            log.exception("worker %s: claim failed; retrying after a pause", self.name)
            self._stopping.wait(self.poll_interval)
        return claimed

    def _rotation(self) -> list[JobRepository[Any]]:
        """The repositories, starting one further each call, so that a busy
        first table cannot starve the others."""
        with self._lock:
            self._turn = (self._turn + 1) % len(self.repositories)
            turn = self._turn
        return self.repositories[turn:] + self.repositories[:turn]

    def _heartbeat(self) -> None:
        with self._lock:
            running = list(self._running.values())
        for repo in self.repositories:
            jobs = [job for r, job in running if r is repo]
            if not jobs:
                continue
            try:
                with self._session() as session, session.begin():
                    session.connection(execution_options=_READ_COMMITTED)
                    owned = repo.heartbeat(session, jobs, lease=self.lease)
            except Exception:
                log.exception("worker %s: heartbeat failed", self.name)
                continue
            with self._lock:
                lost = [job for job in jobs if job.id not in owned and job.lock_token in self._running]
            for job in lost:
                log.warning(
                    "worker %s: lost the lease of job %s (%s); its completion will be refused",
                    self.name, job.id, job.task,
                )

    def _finishing(self, job: Any) -> None:
        """Stop extending the lease of ``job``: its finishing statement follows."""
        with self._lock:
            self._running.pop(job.lock_token, None)

    def _reap(self) -> None:
        for repo in self.repositories:
            try:
                with self._session() as session, session.begin():
                    session.connection(execution_options=_READ_COMMITTED)
                    reaped = repo.reap(session, task_max_attempts=self._task_limits)
                if reaped.requeued or reaped.dead:
                    log.warning(
                        "worker %s: reaped %s expired job(s) of %s: %s back to pending, %s dead",
                        self.name, reaped.requeued + reaped.dead, repo.table.name,
                        reaped.requeued, reaped.dead,
                    )
            except Exception:
                log.exception("worker %s: reap failed", self.name)

    # -- running one job ---------------------------------------------------

    def _count(self, status: str) -> None:
        with self._lock:
            if status == "completed":
                self.result.completed += 1
            elif status == DEAD:
                self.result.dead += 1
            elif status == "lost":
                self.result.lost += 1
            else:
                self.result.retried += 1

    def _run_leased(self, repo: JobRepository[Any], job: Any) -> bool:
        try:
            return self._run_leased_job(repo, job)
        finally:
            self._finishing(job)

    def _run_leased_job(self, repo: JobRepository[Any], job: Any) -> bool:
        task = self.tasks.get(job.task)
        with self._session() as session:
            try:
                with session.begin():
                    session.connection(execution_options=_READ_COMMITTED)
                    if task is None:
                        self._finishing(job)
                        self._fail_unknown(session, repo, job)
                        return True
                    task(job, session)
                    # The handler's pending writes go first, so that their
                    # errors count as the handler's failure.
                    session.flush()
                    self._finishing(job)
                    repo.complete(session, job)
                self._count("completed")
                return True
            except JobLostError as exc:
                log.warning("worker %s: %s; the handler's writes were rolled back", self.name, exc)
                self._count("lost")
                return True
            except BaseException as exc:  # SystemExit from a handler is a failure too
                failure: BaseException = exc
            assert task is not None
            self._finishing(job)
            try:
                with session.begin():
                    session.connection(execution_options=_READ_COMMITTED)
                    self._fail(session, repo, job, task, failure)
            except JobLostError as exc:
                log.warning("worker %s: %s", self.name, exc)
                self._count("lost")
        return True

    def _run_in_transaction(self) -> bool:
        with self._session() as session, session.begin():
            session.connection(execution_options=_READ_COMMITTED)
            for repo in self._rotation():
                jobs = repo.claim(session, queues=self.queues, limit=1, worker=self.name, lease=self.lease)
                if jobs:
                    break
            else:
                return False
            job = jobs[0]
            task = self.tasks.get(job.task)
            if task is None:
                self._fail_unknown(session, repo, job)
                return True
            savepoint = session.begin_nested()
            try:
                task(job, session)
                savepoint.commit()  # flushes the handler's writes inside the savepoint
            except BaseException as exc:  # SystemExit from a handler is a failure too
                savepoint.rollback()
                self._fail(session, repo, job, task, exc)
                return True
            repo.complete(session, job)
        self._count("completed")
        return True

    def _fail(self, session: Session, repo: JobRepository[Any], job: Any, task: Task, exc: BaseException) -> None:
        if isinstance(exc, RetryJob):
            status = repo.fail(
                session, job, f"RetryJob: {exc}", delay=exc.delay if exc.at is None else None,
                at=exc.at, policy=task.retry, max_attempts=task.max_attempts,
            )
        else:
            log.info("worker %s: job %s (%s) failed: %r", self.name, job.id, job.task, exc)
            status = repo.fail(
                session, job, describe_error(exc), policy=task.retry, max_attempts=task.max_attempts
            )
        self._count(status)

    def _fail_unknown(self, session: Session, repo: JobRepository[Any], job: Any) -> None:
        known = ", ".join(sorted(t.name for t in self.tasks)) or "none"
        log.error("worker %s: job %s has unknown task %r", self.name, job.id, job.task)
        repo.fail(
            session, job,
            f"unknown task {job.task!r}: no handler is registered for it in this worker "
            f"(registered: {known})",
            discard=True,
        )
        self._count(DEAD)

    # -- signals -----------------------------------------------------------

    def _install_signal_handlers(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def graceful(signum: int, frame: Any) -> None:
            log.info("worker %s: %s received, finishing running jobs", self.name, signal.Signals(signum).name)
            self.stop()

        for sig in previous:
            signal.signal(sig, graceful)

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore
