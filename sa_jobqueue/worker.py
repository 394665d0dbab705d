"""Worker: claim jobs, run each with a fresh session, finish them.

::

    worker = Worker(engine, emails, tasks, queues=["signup"], concurrency=4)
    worker.run()                      # until SIGINT/SIGTERM
    worker.run(until_empty=True)      # scripts and tests: stop when idle

Two modes (see docs/concepts.md):

* ``lease`` (default): one statement claims up to the free capacity and
  commits at once; each job then runs in its own session and transaction,
  where the handler's writes and the fenced completion commit together. A
  handler that takes no session has nothing to commit with its completion:
  those completions are buffered and written in one statement per flush. The
  worker extends the leases of its running jobs (heartbeat) and reaps expired
  leases of crashed workers.
* ``transaction``: each slot claims a batch in one transaction that holds the
  row locks, runs each job in its own SAVEPOINT (a failure rolls back only its
  job and is still recorded), completes the batch in one statement and
  commits once.

Idle workers poll with backoff; with ``listen`` (the default) a listener
connection wakes them when a job is enqueued. A worker with concurrency C
uses at most C + 2 connections: one per slot, one for claims, heartbeats,
reaping and batched completions, and one for the listener.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import Engine, event, func, select
from sqlalchemy.orm import Session, sessionmaker

from . import signals
from .completions import CompletionBuffer
from .errors import InvalidArgumentError
from .execution import READ_COMMITTED, JobRunner
from .listener import Listener
from .periodic import PeriodicScheduler, check_interval
from .registry import TaskRegistry
from .repository import DEFAULT_LEASE, JobRepository, default_worker_name
from .slots import Slots
from .spec import (
    check_duration,
    check_lease,
    check_poll_interval,
    check_queues,
    check_repositories,
    check_worker_name,
    positive_int,
)
from .watchdog import Watchdog

log = logging.getLogger("sa_jobqueue.worker")

Mode = Literal["lease", "transaction"]
DEFAULT_TRANSACTION_BATCH = 10
# Claims a lease-mode worker may have in flight at once.
CLAIMERS = 2
DEFAULT_STALL_TIMEOUT = timedelta(seconds=10)


@dataclass
class WorkerResult:
    """What a worker did: jobs completed, retried, sent to dead, and lost
    (finished too late: the lease had expired and the job was reaped)."""

    completed: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0


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
        listen: bool = True,
        batch_size: int | None = None,
        name: str | None = None,
        stall_timeout: timedelta | None = DEFAULT_STALL_TIMEOUT,
        periodic_interval: float = 1.0,
    ) -> None:
        if isinstance(bind, Engine):
            self._sessions: sessionmaker[Session] = sessionmaker(bind, expire_on_commit=False)
        elif isinstance(bind, sessionmaker):
            self._sessions = bind
        else:
            raise InvalidArgumentError("bind", "must be an Engine or a sessionmaker")
        repos = check_repositories(repositories)
        if not isinstance(tasks, TaskRegistry):
            raise InvalidArgumentError("tasks", "must be a TaskRegistry")
        self.concurrency = positive_int("concurrency", concurrency)
        if mode not in ("lease", "transaction"):
            raise InvalidArgumentError("mode", f"must be 'lease' or 'transaction', got {mode!r}")
        lease = check_lease("lease", lease)
        if heartbeat_interval is not None:
            check_duration("heartbeat_interval", heartbeat_interval)
        if reap_interval is not None:
            check_duration("reap_interval", reap_interval)
        poll_interval = check_poll_interval(poll_interval)
        name = check_worker_name("name", name)
        queues = check_queues(queues)
        if batch_size is not None:
            positive_int("batch_size", batch_size)
        if stall_timeout is not None:
            stall_timeout = check_lease("stall_timeout", stall_timeout)
        engine = self._sessions.kw.get("bind")
        if listen and not isinstance(engine, Engine):
            raise InvalidArgumentError("listen", "needs an Engine, or a sessionmaker bound to one")
        self._url = engine.url if isinstance(engine, Engine) else None
        # Claims, heartbeats, reaps and batched completions are one statement
        # each: in autocommit they cost one round trip instead of three
        # (BEGIN, the statement, COMMIT), and one statement is atomic anyway.
        # A sessionmaker without one engine (binds per table) keeps its own.
        self._control: sessionmaker[Session] | None = (
            sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False)
            if isinstance(engine, Engine) else None
        )
        self.repositories = repos
        self.tasks = tasks
        self.queues = queues
        self.mode: Mode = mode
        self.lease = lease
        self.heartbeat_interval = (heartbeat_interval or lease / 3).total_seconds()
        self.reap_interval = (reap_interval or lease / 2).total_seconds()
        self.poll_interval = poll_interval
        self.listen = listen
        # A watchdog frees connections stalled with a statement in flight
        # (sa_jobqueue/watchdog.py); it needs the engine to watch its pool.
        self.stall_timeout = stall_timeout if isinstance(engine, Engine) else None
        self._engine = engine if isinstance(engine, Engine) else None
        self.batch_size = batch_size or (DEFAULT_TRANSACTION_BATCH if mode == "transaction" else None)
        # With a batch_size, lease mode claims ahead of its threads and holds
        # up to two batches: one running, one ready. The next claim goes out
        # as soon as a whole batch fits, so a batch is always queued while a
        # claim travels (a single batch would leave the threads idle for the
        # claim's round trip each time it drains). Claimed jobs wait in the
        # slots' queue with their leases extended.
        if mode == "lease" and batch_size:
            self._capacity = max(self.concurrency, (CLAIMERS + 1) * batch_size)
        else:
            self._capacity = self.concurrency
        self._reserved = 0  # jobs asked for by claims in flight (lease mode)
        self._last_claim_full = True
        self.name = name or default_worker_name()
        self.result = WorkerResult()
        self._task_limits = {t.name: t.max_attempts for t in tasks if t.max_attempts is not None}
        self._stopping = threading.Event()
        # Set by job completions, notifications, full buffers and stop():
        # the loop's one place to sleep.
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._turn = 0
        self._notified = False
        self._listener: Listener | None = None
        self._completions = CompletionBuffer()
        self._runner = JobRunner(self)
        # Jobs whose lease this worker extends, by lock token (lease mode). A
        # job leaves before its finishing statement, so a heartbeat never
        # mistakes a job completed a moment ago for a lost one.
        self._running: dict[Any, tuple[JobRepository[Any], Any]] = {}
        # Periodic jobs (sa_jobqueue/periodic.py): the registry's schedules of
        # the queues this worker serves, enqueued into its first job table.
        self.periodic_interval = check_interval("periodic_interval", periodic_interval)
        scheduler = PeriodicScheduler(repos[0], tasks, queues=queues)
        self._periodic = scheduler if scheduler else None
        self._periodic_failing = False

    # -- public ----------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; :meth:`run` returns once the running jobs finish."""
        self._stopping.set()
        self._wake.set()

    def run(self, *, until_empty: bool = False) -> WorkerResult:
        """Run until :meth:`stop`, SIGINT or SIGTERM (or, with ``until_empty``,
        until nothing is runnable and nothing is running). Jobs in flight are
        always finished, and buffered completions written, before it returns."""
        restore = self._install_signal_handlers()
        listener = self._listener = self._start_listener() if self.listen and not until_empty else None
        unwatch = self._start_watchdog()
        slots = Slots(self.concurrency, name="sa_jobqueue", on_done=self._slot_done)
        claimers = Slots(CLAIMERS if self.mode == "lease" else 0, name="sa_jobqueue-claim",
                         on_done=lambda _: self._wake.set())
        try:
            self._loop(slots, claimers, until_empty)
        finally:
            claimers.close()  # before the slots: a claim in flight still hands them jobs
            slots.close()
            if listener is not None:
                listener.stop()
                self._listener = None
            unwatch()
            restore()
        return self.result

    # -- the loop --------------------------------------------------------

    def _loop(self, slots: Slots, claimers: Slots, until_empty: bool) -> None:
        idle_wait = 0.0
        next_reap = time.monotonic()
        next_heartbeat = next_reap if self.mode == "lease" else float("inf")
        next_periodic = next_reap if self._periodic is not None else float("inf")
        found = True  # did the latest claim find work?
        next_probe = 0.0  # while idle: when to claim again (unless woken)
        while not self._stopping.is_set():
            self._wake.clear()
            now = time.monotonic()
            if now >= next_reap:
                self._reap()
                next_reap = now + self.reap_interval
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + self.heartbeat_interval
            if now >= next_periodic:
                if self._run_periodic():
                    found = True  # claim what was just enqueued, without waiting for a NOTIFY
                next_periodic = now + self.periodic_interval
            # Claimers first: a claim that ends after its snapshot counts as in
            # flight, and one that ended before has handed its jobs to the
            # slots, whose snapshot comes next.
            hits, misses, claiming = claimers.take_results()
            ran, empty, inflight = slots.take_results()
            if self._completions.due():
                self._flush_completions()
            if self._take_notification():
                found = True
            free = self._capacity - inflight
            if self.mode == "lease":
                # Claims run in claimer threads, up to CLAIMERS at once, so that
                # the server works on the next batch while this one runs.
                if hits:
                    found, idle_wait = True, 0.0  # a short batch is not an empty queue
                elif misses and not claiming:
                    found = False
                    idle_wait = self._next_idle_wait(idle_wait)
                    next_probe = time.monotonic() + idle_wait
                if ran and not found:
                    # A job that just finished may have made work runnable (a
                    # retry due now, a job its handler enqueued): look once more
                    # before going idle, or before until_empty returns.
                    found = True
                # While idle, one probe at a time, once the idle wait is over.
                may_claim = found or (not claiming and time.monotonic() >= next_probe)
                # Two claims at once only while claims come back full: after a
                # short one the queue is about empty, and one probe will do.
                parallel = CLAIMERS if self._last_claim_full else 1
                while may_claim and len(claimers) < parallel and self._wants_claim(inflight + self._reserved):
                    ask = min(self._capacity - inflight - self._reserved, self.batch_size or free)
                    with self._lock:
                        self._reserved += ask
                    claimers.submit(self._claim_into, slots, ask)
                    may_claim = found
            else:
                # Each slot claims a batch in its own transaction; the slots'
                # results tell whether the queues had work.
                if ran:
                    found, idle_wait = True, 0.0
                if empty and not ran:
                    found = False
                    idle_wait = self._next_idle_wait(idle_wait)
                    next_probe = time.monotonic() + idle_wait
                if until_empty and not found and not inflight and not len(self._completions):
                    break  # the last probe found nothing, and nothing runs
                if found:
                    probes = free
                elif free > 0 and time.monotonic() >= next_probe:
                    # While idle, one probe per idle wait, whatever the other
                    # slots do: a long batch must not keep jobs that became
                    # runnable without a NOTIFY (retries, scheduled jobs, rows
                    # a dead transaction released) waiting for it to end.
                    probes = 1
                    next_probe = time.monotonic() + (idle_wait or self.poll_interval)
                else:
                    probes = 0
                for _ in range(probes):
                    slots.submit(self._runner.run_transaction_batch)
            if (self.mode == "lease" and until_empty and not found and not inflight and not claiming
                    and not len(claimers)
                    and not len(self._completions)):
                break
            if found or (self.mode == "transaction" and inflight):
                timeout = self.poll_interval  # a finishing slot wakes the loop sooner
            else:
                timeout = next_probe - time.monotonic()
            self._wake.wait(self._sleep_for(timeout, next_heartbeat, next_reap, next_periodic))
        while len(slots) or len(claimers):
            self._wake.wait(self.poll_interval)
            self._wake.clear()
            if self._completions.due():
                self._flush_completions()
        self._flush_completions(final=True)

    def _wants_claim(self, inflight: int) -> bool:
        """Lease mode: claim while a thread is idle, or once a whole batch fits.

        Topping up one job per completion would turn each claim of 100 into
        100 claims of 1.
        """
        free = self._capacity - inflight
        return free > 0 and (inflight < self.concurrency or free >= (self.batch_size or 1))

    def _slot_done(self, active: int) -> None:
        """A slot finished a call: wake the loop when it may claim (or probe) again."""
        if self.mode == "transaction" or self._wants_claim(active + self._reserved):
            self._wake.set()

    def _sleep_for(self, wait: float, *deadlines: float) -> float:
        flush_at = self._completions.deadline()
        until = min((*deadlines, flush_at if flush_at is not None else float("inf")))
        return max(0.0, min(wait, until - time.monotonic(), self.poll_interval))

    def _next_idle_wait(self, previous: float) -> float:
        if self._listener is not None and self._listener.connected.is_set():
            # Enqueues wake us; polling only catches scheduled jobs and retries.
            return self.poll_interval * random.uniform(0.8, 1.0)
        # Exponential backoff from 50 ms to poll_interval, ±25% jitter so that
        # many idle workers do not poll in step.
        base = min(self.poll_interval, max(0.05, previous * 2))
        return base * random.uniform(0.75, 1.25)

    # -- wake-ups ----------------------------------------------------------

    def _start_listener(self) -> Listener:
        assert self._url is not None
        conninfo = self._url.set(drivername="postgresql").render_as_string(hide_password=False)
        listener = Listener(
            conninfo, sorted({repo.channel for repo in self.repositories}),
            on_notify=self._on_notify, on_connect=self._on_notify_any,
        )
        listener.start()
        return listener

    def _start_watchdog(self) -> Callable[[], None]:
        """Watch every connection of the engine's pool the worker touches; return the undo."""
        if self.stall_timeout is None or self._engine is None or self._url is None:
            return lambda: None
        engine = self._engine
        conninfo = self._url.set(drivername="postgresql").render_as_string(hide_password=False)
        watchdog = Watchdog(conninfo, after=self.stall_timeout.total_seconds())

        def watch(dbapi_connection: Any, *rest: Any) -> None:
            watchdog.watch(dbapi_connection)

        # "connect" sees new connections; "checkout" those the pool already held.
        event.listen(engine, "connect", watch)
        event.listen(engine, "checkout", watch)
        watchdog.start()

        def unwatch() -> None:
            event.remove(engine, "connect", watch)
            event.remove(engine, "checkout", watch)
            watchdog.stop()

        return unwatch

    def _on_notify(self, channel: str, queue: str) -> None:
        if queue in self.queues:
            self._on_notify_any()

    def _on_notify_any(self) -> None:
        with self._lock:
            self._notified = True
        self._wake.set()

    def _take_notification(self) -> bool:
        with self._lock:
            notified, self._notified = self._notified, False
        return notified

    # -- statements in short transactions of the control connection -------

    def _claim_into(self, slots: Slots, ask: int) -> bool:
        """A claimer thread: claim up to ``ask`` jobs and queue them for the slots."""
        try:
            claimed = self._claim(ask)
            self._last_claim_full = len(claimed) == ask
            for repo, job in claimed:
                with self._lock:
                    self._running[job.lock_token] = (repo, job)
                slots.submit(self._runner.run_leased, repo, job)
        finally:
            with self._lock:
                self._reserved -= ask
        return bool(claimed)

    def _claim(self, free: int) -> list[tuple[JobRepository[Any], Any]]:
        claimed: list[tuple[JobRepository[Any], Any]] = []
        try:
            for repo in self._rotation():
                if free <= 0:
                    break
                with self._control_transaction() as session:
                    jobs = repo.claim(session, queues=self.queues, limit=free, worker=self.name, lease=self.lease)
                claimed.extend((repo, job) for job in jobs)  # committed: ours now
                free -= len(jobs)
        except Exception:
            log.exception("worker %s: claim failed; retrying after a pause", self.name)
            self._stopping.wait(self.poll_interval)
        return claimed

    @contextmanager
    def _control_transaction(self) -> Iterator[Session]:
        """A transaction for one of the worker's own statements: autocommit
        when the worker knows its engine (see __init__), else a READ
        COMMITTED transaction of the app's sessionmaker."""
        with (self._control or self._sessions)() as session, session.begin():
            if self._control is None:
                session.connection(execution_options=READ_COMMITTED)
            yield session

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
                with self._control_transaction() as session:
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

    def _reap(self) -> None:
        for repo in self.repositories:
            try:
                with self._control_transaction() as session:
                    reaped = repo.reap(session, task_max_attempts=self._task_limits)
                if reaped.requeued or reaped.dead:
                    log.warning(
                        "worker %s: reaped %s expired job(s) of %s: %s back to pending, %s dead",
                        self.name, reaped.requeued + reaped.dead, repo.table.name,
                        reaped.requeued, reaped.dead,
                    )
                    signals.send(signals.jobs_reaped, self, repository=repo, table=repo.table.name,
                                 requeued=reaped.requeued, dead=reaped.dead)
            except Exception:
                log.exception("worker %s: reap failed", self.name)

    def _run_periodic(self) -> bool:
        """Enqueue the due ticks of the periodic schedules; True if any job was enqueued."""
        assert self._periodic is not None
        try:
            if self._control is not None:
                # Nothing new due (the usual case): one autocommit SELECT now(), no transaction.
                with self._control_transaction() as session:
                    now = session.execute(select(func.now())).scalar_one()
                if not self._periodic.due(now):
                    self._periodic_failing = False
                    return False
            with self._sessions() as session, session.begin():
                session.connection(execution_options=READ_COMMITTED)
                jobs = self._periodic.run_due(session)
        except Exception:
            # Logged once per run of failures (a missing sa_jobqueue_periodic
            # table would otherwise log every periodic_interval).
            if not self._periodic_failing:
                log.exception("worker %s: the periodic pass failed (is the table sa_jobqueue_periodic "
                              "created? see docs/periodic.md)", self.name)
            self._periodic_failing = True
            return False
        self._periodic_failing = False
        return bool(jobs)

    def _flush_completions(self, *, final: bool = False) -> None:
        """Write buffered completions, one fenced statement (and transaction) per table.

        Called by the loop when the oldest is due, by the slot thread that
        fills the buffer, and at shutdown (``final``: retried with backoff).
        """
        for attempt in range(5 if final else 1):
            entries = self._completions.take()
            if not entries:
                return
            for repo in {entry[0] for entry in entries}:
                mine = [entry for entry in entries if entry[0] is repo]
                try:
                    with self._control_transaction() as session:
                        done = repo.complete_many(session, [job for _, job, _ in mine])
                except Exception:
                    log.exception("worker %s: writing %s completions failed", self.name, len(mine))
                    self._completions.put_back(mine)
                    continue
                for _, job, duration in mine:
                    self._finishing(job)
                    if job.id in done:
                        self._count("completed")
                        signals.send(signals.job_succeeded, self, job=job, duration=duration)
                    else:
                        log.warning("worker %s: job %s finished after its lease was lost", self.name, job.id)
                        self._count("lost")
            if final and len(self._completions):
                time.sleep(min(self.poll_interval, 0.2 * 2**attempt))  # stop() may be set: sleep
        if final and len(self._completions):
            log.error("worker %s: %s completions could not be written; their leases will expire "
                      "and the jobs run again", self.name, len(self._completions))

    # -- bookkeeping shared with the job runner ---------------------------

    def _finishing(self, job: Any) -> None:
        """Stop extending the lease of ``job``: its finishing statement follows."""
        with self._lock:
            self._running.pop(job.lock_token, None)

    def _count(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            if outcome == "completed":
                self.result.completed += n
            elif outcome == "dead":
                self.result.dead += n
            elif outcome == "lost":
                self.result.lost += n
            else:
                self.result.retried += n

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
