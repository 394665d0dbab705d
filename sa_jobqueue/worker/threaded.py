"""Worker: the thread driver around the job lifecycle.

::

    worker = Worker(engine, emails, tasks, queues=["signup"], concurrency=4)
    worker.run()                      # until SIGINT/SIGTERM
    worker.run(until_empty=True)      # scripts and tests: stop when idle

The driver owns the threads and the clock; what to do is decided by the
pacer (:mod:`~sa_jobqueue.worker.pace`), how a job runs by the mode
(:mod:`~sa_jobqueue.worker.lease`, :mod:`~sa_jobqueue.worker.transaction`),
and the duties (heartbeat, reap, periodic, batched completions) are pieces
of their own. See docs/architecture.md.

Connections: the jobs' sessions come from the application's engine (or
sessionmaker); the worker's own statements (claims, heartbeats, reaps,
batched completions, failures) run in autocommit on a pool of its own,
connected exactly as the application's engine connects, so that handlers
that leak sessions cannot starve the worker. With concurrency C a worker
uses at most C connections of the application's pool, and of its own
CLAIMERS + 1 (C more at peaks), one for the listener and one for the
watchdog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from ..connections import raw_connect, worker_engine
from ..errors import InvalidArgumentError
from ..listener import Listener
from ..periodic import PeriodicScheduler
from ..registry import TaskRegistry
from ..repository import DEFAULT_LEASE, JobRepository, check_repositories, default_worker_name
from ..runnable import refuse_async_tasks
from ..watchdog import Watchdog
from .books import Books, WorkerResult
from .completer import Completer
from .context import Control, WorkerContext
from .face import WorkerFace
from .job_sessions import JobSessions
from .lease import LeaseMode
from .maintenance import PeriodicPass, Reaper
from .options import CLAIMERS, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_STALL_TIMEOUT, Mode, WorkerOptions
from .pace import Pacer
from .presence_beat import PauseWatch, PresenceBeat
from .shutdown import Shutdown
from .transaction import TransactionMode

log = logging.getLogger("sa_jobqueue.worker")


class Worker(WorkerFace):
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
        shutdown_timeout: timedelta | float = DEFAULT_SHUTDOWN_TIMEOUT,
        job_timeout: timedelta | float | None = None,
        max_stuck_slots: int | None = None,
    ) -> None:
        if isinstance(bind, Engine):
            sessions: sessionmaker[Session] = sessionmaker(bind, expire_on_commit=False)
        elif isinstance(bind, sessionmaker):
            sessions = bind
        else:
            raise InvalidArgumentError("bind", "must be an Engine or a sessionmaker")
        repos = check_repositories(repositories)
        if not isinstance(tasks, TaskRegistry):
            raise InvalidArgumentError("tasks", "must be a TaskRegistry")
        refuse_async_tasks(tasks)
        self.options = WorkerOptions.check(
            queues=queues, concurrency=concurrency, mode=mode, lease=lease, heartbeat_interval=heartbeat_interval,
            reap_interval=reap_interval, poll_interval=poll_interval, listen=listen, batch_size=batch_size,
            name=name, stall_timeout=stall_timeout, periodic_interval=periodic_interval,
            shutdown_timeout=shutdown_timeout, job_timeout=job_timeout, max_stuck_slots=max_stuck_slots,
        )
        engine = sessions.kw.get("bind")
        if listen and not isinstance(engine, Engine):
            raise InvalidArgumentError("listen", "needs an Engine, or a sessionmaker bound to one")
        self._engine = engine if isinstance(engine, Engine) else None
        self._sessions = sessions
        self.repositories = repos
        self.tasks = tasks
        self.name = self.options.name or default_worker_name()
        self._books = Books()
        self._ctx: WorkerContext | None = None
        self._shutdown: Shutdown | None = None
        self._stop_before_run = False
        self._notified = False
        self._notify_lock = threading.Lock()
        # The loop's step (the pacer's decisions and the claims they send) is
        # taken by the loop's thread and by the listener's on a notification,
        # one at a time; _stepper is the mode while the listener may take it.
        self._step_lock = threading.Lock()
        self._stepper: LeaseMode | TransactionMode | None = None

    # -- public ----------------------------------------------------------

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming: :meth:`run` hands back the claimed jobs not started,
        waits for the running ones up to ``shutdown_timeout`` and returns.
        ``now``: return without waiting (as a second SIGTERM does)."""
        shutdown = self._shutdown
        if shutdown is not None:
            if now:
                shutdown.abort.set()
            shutdown.stopping.set()
            shutdown.wake.set()
        else:
            self._stop_before_run = True

    def run(self, *, until_empty: bool = False) -> WorkerResult:
        """Run until :meth:`stop`, SIGINT or SIGTERM (or, with ``until_empty``,
        until nothing is runnable and nothing is running); see :meth:`stop`
        and docs/concepts.md for what a stop waits for.

        Raises :class:`~sa_jobqueue.WorkerStuckError` when more threads are
        stuck in handlers past their deadline than ``max_stuck_slots``."""
        own = self._own_engine()
        ctx = self._ctx = self._context(own)
        shutdown = self._shutdown = Shutdown(self.name, ctx.stopping, ctx.wake)
        if self._stop_before_run:
            ctx.stopping.set()
        restore = shutdown.install()
        mode: LeaseMode | TransactionMode = LeaseMode(ctx) if self.options.mode == "lease" else TransactionMode(ctx)
        listener = self._start_listener(mode) if self.options.listen and not until_empty else None
        unwatch = self._start_watchdog(ctx, own)
        presence = PresenceBeat(ctx, "threads")
        try:
            self._loop(ctx, mode, listener, until_empty, presence)
            self._wind_down(ctx, mode, shutdown)
        finally:
            self._end_steps()
            # Threads still in a handler are daemons: the process may exit under them.
            mode.close(wait=not len(mode.slots))
            presence.withdraw()
            if listener is not None:
                listener.stop()
            unwatch()
            restore()
            if own is not None:
                own.dispose()
        return self.result

    # -- the loop --------------------------------------------------------

    def _loop(self, ctx: WorkerContext, mode: LeaseMode | TransactionMode, listener: Listener | None,
              until_empty: bool, presence: PresenceBeat) -> None:
        now = time.monotonic()
        duties: list[tuple[Callable[[], bool], float, list[float]]] = [
            (PauseWatch(ctx).run, ctx.options.poll_interval, [now]),  # first: no claim from a paused queue
            (presence.run, presence.interval, [now]),
            (Reaper(ctx).run, ctx.options.reap_interval, [now]),
        ]
        if isinstance(mode, LeaseMode):
            duties.append((_never_finds(mode.heartbeat), ctx.options.heartbeat_interval, [now]))
        # The registry's schedules of the queues this worker serves, enqueued into its first job table.
        scheduler = PeriodicScheduler(ctx.repositories[0], self.tasks, queues=ctx.options.queues)
        periodic = PeriodicPass(ctx, scheduler) if scheduler else None
        if periodic is not None:
            duties.append((periodic.run, periodic.interval, [now]))
        while not ctx.stopping.is_set():
            ctx.wake.clear()
            now = time.monotonic()
            found = False  # a duty made work runnable: claim it without waiting for a NOTIFY
            for run_duty, interval, next_at in duties:
                if now >= next_at[0]:
                    found = run_duty() or found
                    next_at[0] = now + interval
            mode.watch(now)
            if ctx.completer.due(now):
                ctx.completer.flush()
            notified = self._take_notification() or found
            with self._step_lock:
                if notified:
                    ctx.pacer.notified()
                if ctx.stopping.is_set():  # a stop while the duties ran: no claim may start now
                    break
                listening = listener is not None and listener.connected.is_set()
                drained = mode.step(time.monotonic(), listening=listening, until_empty=until_empty)
                # The duties have run once (the paused queues are known):
                # notifications may take their step at once from now on.
                self._stepper = mode if listener is not None else None
            if drained:
                break
            flush_at = ctx.completer.deadline()
            deadline = min([d[2][0] for d in duties] + ([flush_at] if flush_at is not None else []))
            ctx.wake.wait(mode.sleep(time.monotonic(), deadline))

    def _wind_down(self, ctx: WorkerContext, mode: LeaseMode | TransactionMode, shutdown: Shutdown) -> None:
        """Stop claiming, hand back what did not start, wait for the running
        jobs up to the shutdown timeout, write the buffered completions."""
        until = time.monotonic() + ctx.options.shutdown_timeout.total_seconds()
        self._end_steps()  # no notification sends a claim from now on
        if not shutdown.abort.is_set():
            mode.stop_claiming(until)
        next_beat = time.monotonic() + ctx.options.heartbeat_interval
        while not shutdown.abort.is_set():
            remaining = until - time.monotonic()
            if mode.slots.wait_idle(max(0.0, min(remaining, 0.05))) or remaining <= 0:
                break
            now = time.monotonic()
            mode.watch(now)
            if isinstance(mode, LeaseMode):
                if now >= next_beat:
                    mode.heartbeat()  # jobs still running keep their leases while we wait
                    next_beat = now + ctx.options.heartbeat_interval
            if ctx.completer.due(now):
                ctx.completer.flush()
        if not shutdown.abort.is_set():
            ctx.completer.final_flush(until=max(until, time.monotonic() + 1.0))
        if len(mode.slots):
            log.warning("worker %s: stopped with %s", ctx.name, mode.describe_running())

    # -- parts -----------------------------------------------------------------

    def _context(self, own: Engine | None) -> WorkerContext:
        control = Control(sessionmaker(own, expire_on_commit=False) if own is not None else None, self._sessions,
                          [repo.table for repo in self.repositories])
        return WorkerContext(
            options=self.options, name=self.name, tasks=self.tasks, repositories=self.repositories,
            sessions=self._sessions, job_sessions=JobSessions(self._sessions), control=control, books=self._books,
            completer=Completer(self._books, control, sender=self, name=self.name, engine=control.engine),
            pacer=_pacer(self.options), sender=self, step_now=self._step_now,
        )

    def _own_engine(self) -> Engine | None:
        """The worker's own autocommit pool (see the module docstring), when it knows the engine."""
        if self._engine is None:
            return None
        # The worker's pool shares the application's dialect, which initializes
        # itself on its engine's first connection: make that happen now, before
        # two pools can race to it (a half-initialized dialect fails statements).
        try:
            with self._engine.connect():
                pass
        except Exception as exc:
            log.warning("worker %s: cannot connect yet (%r); the worker retries as it goes", self.name, exc)
        return worker_engine(self._engine, pool_size=CLAIMERS + 1, max_overflow=self.options.concurrency,
                             name=self.name)

    def _start_listener(self, mode: LeaseMode | TransactionMode) -> Listener:
        assert self._engine is not None
        channels = {repo.channel: "queue" for repo in self.repositories}
        if isinstance(mode, LeaseMode):
            channels.update({repo.cancel_channel: "cancel" for repo in self.repositories})

        def on_notify(channel: str, payload: str) -> None:
            if channels.get(channel) == "cancel":
                if payload.isdigit():
                    mode.cancel_notified(int(payload))  # type: ignore[union-attr]
            elif payload in self.options.queues:
                self._on_notify_any()

        listener = Listener(raw_connect(self._engine), sorted(channels), on_notify=on_notify,
                            on_connect=self._on_notify_any)
        listener.start()
        return listener

    def _start_watchdog(self, ctx: WorkerContext, own: Engine | None) -> Callable[[], None]:
        """Watch the connections the worker uses: its own pool's, and those its
        jobs hold on the application's engine while they hold them; return the undo."""
        if self.options.stall_timeout is None or own is None or self._engine is None:
            return lambda: None
        watchdog = Watchdog(raw_connect(self._engine), after=self.options.stall_timeout.total_seconds())
        unwatch_own = watchdog.watch_engine(own)
        ctx.watch_connection = watchdog.watch_jobs()
        watchdog.start()

        def stop() -> None:
            unwatch_own()
            watchdog.stop()

        return stop

    def _on_notify_any(self) -> None:
        """A notification (or the listener's connection): in the listener's
        thread, take the loop's step at once, so that a notified job waits
        for no wake-up of the loop's thread; before the loop's first pass and
        once it stops, or if that fails, wake the loop to take it."""
        if self._step_now(True):
            return
        with self._notify_lock:
            self._notified = True
        if self._ctx is not None:
            self._ctx.wake.set()

    def _step_now(self, notified: bool) -> bool:
        """Take the loop's step in this thread (``notified``: after a
        notification); False when no step may be taken outside the loop's
        thread now: before its first pass, once it stops, or in a worker that does not listen."""
        ctx = self._ctx
        with self._step_lock:
            mode = self._stepper
            if mode is None or ctx is None or ctx.stopping.is_set():
                return False
            try:
                if notified:
                    ctx.pacer.notified()
                mode.step(time.monotonic(), listening=True, until_empty=False)
            except Exception:  # the loop's own step takes it then
                log.exception("worker %s: a step on notification failed", self.name)
                return False
        return True

    def _end_steps(self) -> None:
        """No notification takes a step after this returns (one taking it now has ended)."""
        with self._step_lock:
            self._stepper = None

    def _take_notification(self) -> bool:
        with self._notify_lock:
            notified, self._notified = self._notified, False
        return notified


def _never_finds(duty: Callable[[], None]) -> Callable[[], bool]:
    def run() -> bool:
        duty()
        return False

    return run


def _pacer(options: WorkerOptions) -> Pacer:
    return Pacer(
        capacity=options.capacity, concurrency=options.concurrency, batch_size=options.batch_size,
        poll_interval=options.poll_interval, claimers=CLAIMERS if options.mode == "lease" else 0,
    )
