"""AsyncWorker: the asyncio driver around the job lifecycle.

::

    worker = AsyncWorker(engine, emails, tasks, queues=["signup"], concurrency=100)
    await worker.run()                     # until SIGINT/SIGTERM or stop()
    await worker.run(until_empty=True)     # scripts and tests: stop when idle

The second driver of the lifecycle the thread worker runs
(:mod:`sa_jobqueue.worker`): the same options, pacer, books, failure rules,
heartbeat, reaper, periodic pass and batched completions, their statements
run on the event loop through SQLAlchemy's greenlet
(:mod:`~sa_jobqueue.aio.bridge`); each job runs as a task of its own
(:mod:`~sa_jobqueue.aio.executor`), ``concurrency`` of them at once.

Connections (the budget docs/asyncio.md states): jobs whose handler takes a
session hold one connection each of the application's ``AsyncEngine``, at
most ``max_sessions`` at once (its ``pool_size + max_overflow`` unless told),
kept for the next job while claimed jobs wait (:mod:`~sa_jobqueue.aio.job_sessions`); the
worker's own statements run in autocommit on a pool of its own of at most
2 * (CLAIMERS + 1) connections; the listener holds one more. Sync handlers
that take a session hold one of ``sync_bind``'s, at most ``threads`` at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from ..checks import positive_int
from ..connections import driver_connect, worker_engine
from ..errors import InvalidArgumentError
from ..inflight import ConnectionWatch
from ..periodic import PeriodicScheduler
from ..registry import TaskRegistry
from ..repository import DEFAULT_LEASE, check_repositories, default_worker_name
from ..worker.books import Books, WorkerResult
from ..worker.completer import Completer
from ..worker.context import Control, WorkerContext
from ..worker.executor import JobExecutor
from ..worker.face import WorkerFace
from ..worker.job_sessions import JobSessions
from ..worker.maintenance import PeriodicPass, Reaper
from ..worker.options import CLAIMERS, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_STALL_TIMEOUT, Mode, WorkerOptions
from ..worker.pace import Pacer
from ..worker.presence_beat import PauseWatch, PresenceBeat
from .binds import pool_capacity, sync_repositories, sync_sessions
from .bridge import in_greenlet
from .executor import AsyncJobExecutor
from .lease import AsyncLeaseMode
from .listener import AsyncListener
from .shutdown import install_signal_handlers
from .transaction import AsyncTransactionMode
from .watchdog import WorkerWatch

log = logging.getLogger("sa_jobqueue.worker")
__all__ = ["AsyncWorker"]

Duty = tuple[Callable[[], Awaitable[bool]], float, list[float]]
_INTERRUPT_GRACE = 5.0  # how long the coroutines cancelled at a stop get to record their interrupted attempt
_SETTLE_GRACE = 1.0  # how long, as the run ends, the jobs and claims cancelled then get to end


class AsyncWorker(WorkerFace):
    """Runs jobs of one or more job tables as asyncio tasks: ``async def``
    handlers on the event loop, sync ones in a bounded thread pool."""

    def __init__(
        self,
        bind: AsyncEngine | async_sessionmaker[AsyncSession],
        repositories: Any,
        tasks: TaskRegistry,
        *,
        queues: str | Sequence[str] = "default",
        concurrency: int = 10,
        mode: Mode = "lease",
        threads: int = 4,
        sync_bind: Engine | sessionmaker[Session] | None = None,
        max_sessions: int | None = None,
        lease: timedelta = DEFAULT_LEASE,
        heartbeat_interval: timedelta | None = None,
        reap_interval: timedelta | None = None,
        poll_interval: float = 1.0,
        listen: bool = True,
        batch_size: int | None = None,
        name: str | None = None,
        periodic_interval: float = 1.0,
        shutdown_timeout: timedelta | float = DEFAULT_SHUTDOWN_TIMEOUT,
        job_timeout: timedelta | float | None = None,
        stall_timeout: timedelta | None = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        """``concurrency``: jobs in flight at once; ``threads``: sync handlers
        running at once; ``sync_bind``: the sessions of sync handlers that take
        one; ``max_sessions``: async jobs holding a session at once. The other
        options are :class:`~sa_jobqueue.Worker`'s. Bad options raise
        :class:`~sa_jobqueue.InvalidArgumentError` naming the first bad one."""
        if isinstance(bind, AsyncEngine):
            sessions: async_sessionmaker[AsyncSession] = async_sessionmaker(bind, expire_on_commit=False)
        elif isinstance(bind, async_sessionmaker):
            sessions = bind
        else:
            raise InvalidArgumentError("bind", "must be an AsyncEngine or an async_sessionmaker")
        engine = sessions.kw.get("bind")
        if not isinstance(engine, AsyncEngine):
            raise InvalidArgumentError("bind", "must be an AsyncEngine, or an async_sessionmaker bound to one")
        repos = check_repositories(sync_repositories(repositories))
        if not isinstance(tasks, TaskRegistry):
            raise InvalidArgumentError("tasks", "must be a TaskRegistry")
        self.options = WorkerOptions.check(
            queues=queues, concurrency=concurrency, mode=mode, lease=lease, heartbeat_interval=heartbeat_interval,
            reap_interval=reap_interval, poll_interval=poll_interval, listen=listen, batch_size=batch_size,
            name=name, stall_timeout=stall_timeout, periodic_interval=periodic_interval,
            shutdown_timeout=shutdown_timeout, job_timeout=job_timeout, max_stuck_slots=None,
        )
        self.threads = positive_int("threads", threads)
        self._sync_sessions = sync_sessions(sync_bind)
        needs_sync = sorted(t.name for t in tasks if not t.is_async and t.takes_session)
        if needs_sync and self._sync_sessions is None and self.options.mode == "lease":
            raise InvalidArgumentError(
                "sync_bind", f"is needed: the sync handlers {', '.join(needs_sync)} take a session, and a sync "
                "Session cannot run on an AsyncEngine; give an Engine or sessionmaker for them"
            )
        self.max_sessions = (pool_capacity(engine, self.options.concurrency) if max_sessions is None
                             else positive_int("max_sessions", max_sessions))
        self._engine = engine
        self._sessions = sessions
        self.repositories = repos
        self.tasks = tasks
        self.name = self.options.name or default_worker_name()
        self._books = Books()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = self._abort = self._wake = None  # asyncio.Events of the running loop
        self._stop_before_run: bool | None = None  # None, or whether it was asked "now"
        self._notified = False

    # -- public ----------------------------------------------------------

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming: :meth:`run` hands back the claimed jobs not started,
        waits for the running ones up to ``shutdown_timeout``, cancels those
        still running and returns. ``now``: return without waiting (as a
        second SIGTERM does). Safe to call from any thread."""
        loop = self._loop
        if loop is None:
            self._stop_before_run = bool(self._stop_before_run) or now
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._request_stop(now=now)
        else:
            loop.call_soon_threadsafe(lambda: self._request_stop(now=now))

    async def run(self, *, until_empty: bool = False, handle_signals: bool = True) -> WorkerResult:
        """Run until :meth:`stop`, SIGINT or SIGTERM (or, with ``until_empty``,
        until nothing is runnable and nothing is running).

        ``handle_signals``: route SIGINT and SIGTERM to a stop (first graceful,
        then at once), when run in the main thread. Pass False where the
        server owns the signals (a worker in a web app's lifespan)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        stopping, abort, wake = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._stopping, self._abort, self._wake = stopping, abort, wake  # type: ignore[assignment]
        if self._stop_before_run is not None:
            self._request_stop(now=self._stop_before_run)
        own = await self._own_engine()
        ctx = self._context(own)
        stall = self.options.stall_timeout
        sync_engine = None if self._sync_sessions is None else self._sync_sessions.kw.get("bind")
        watch = WorkerWatch(self._engine, own, None if stall is None else stall.total_seconds(),
                            sync_engine if isinstance(sync_engine, Engine) else None)
        threads = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="sa_jobqueue-sync")
        in_thread = (JobExecutor(self._thread_context(ctx, watch.watch_connection))
                     if self._sync_sessions is not None else None)
        executor = AsyncJobExecutor(ctx, self._sessions, threads, in_thread, asyncio.Semaphore(self.max_sessions),
                                    watch.watch_job)
        mode: AsyncLeaseMode | AsyncTransactionMode = (
            AsyncLeaseMode(ctx, executor, wake.set, self.max_sessions, stopping) if self.options.mode == "lease"
            else AsyncTransactionMode(ctx, self._sessions, threads, stopping, wake.set, watch.watch_job))
        restore = install_signal_handlers(loop, self._signalled) if handle_signals else (lambda: None)
        listener = self._start_listener(mode) if self.options.listen and not until_empty else None
        presence = PresenceBeat(ctx, "asyncio")
        try:
            await self._run_loop(ctx, mode, listener, until_empty, presence)
            await self._wind_down(ctx, mode)
        finally:
            # An error, a stop at once, this task cancelled: what still runs is
            # cancelled and waited for before its connections go back.
            await mode.settle(_SETTLE_GRACE)
            await mode.release_connections()  # kept for the next claim or job
            await in_greenlet(presence.withdraw)
            if listener is not None:
                await listener.stop()
            restore()
            threads.shutdown(wait=False, cancel_futures=True)
            await watch.stop()
            await in_greenlet(own.dispose)
            self._loop = None
        return self.result

    # -- the loop --------------------------------------------------------

    async def _run_loop(self, ctx: WorkerContext, mode: AsyncLeaseMode | AsyncTransactionMode,
                        listener: AsyncListener | None,
                        until_empty: bool, presence: PresenceBeat) -> None:
        assert self._stopping is not None and self._wake is not None
        stopping, wake = self._stopping, self._wake
        now = time.monotonic()
        reaper, pauses = Reaper(ctx), PauseWatch(ctx)
        duties: list[Duty] = [
            (lambda: in_greenlet(pauses.run), ctx.options.poll_interval, [now]),  # first: no claim from a paused queue
            (lambda: in_greenlet(presence.run), presence.interval, [now]),
            (lambda: in_greenlet(reaper.run), ctx.options.reap_interval, [now]),
        ]
        if isinstance(mode, AsyncLeaseMode):
            duties.append((mode.heartbeat, ctx.options.heartbeat_interval, [now]))
        scheduler = PeriodicScheduler(ctx.repositories[0], self.tasks, queues=ctx.options.queues)
        if scheduler:
            periodic = PeriodicPass(ctx, scheduler)
            duties.append((lambda: in_greenlet(periodic.run), periodic.interval, [now]))
        while not stopping.is_set():
            wake.clear()
            now = time.monotonic()
            for run_duty, interval, next_at in duties:
                if now >= next_at[0]:
                    if await run_duty():
                        ctx.pacer.notified()  # claim what was just enqueued, without waiting for a NOTIFY
                    next_at[0] = now + interval
            next_due = mode.watch(now)
            if ctx.completer.due(now):
                await in_greenlet(ctx.completer.flush)
            if self._notified:
                self._notified = False
                ctx.pacer.notified()
            if stopping.is_set():  # a stop while a duty was awaited: no claim may start now
                break
            listening = listener is not None and listener.connected.is_set()
            if mode.step(time.monotonic(), listening=listening, until_empty=until_empty):
                break
            flush_at = ctx.completer.deadline()
            deadline = min([d[2][0] for d in duties] + [next_due] + ([flush_at] if flush_at is not None else []))
            await _sleep(wake, ctx.pacer.sleep(time.monotonic(), busy=False, deadline=deadline))

    async def _wind_down(self, ctx: WorkerContext, mode: AsyncLeaseMode | AsyncTransactionMode) -> None:
        """Stop claiming, hand back what did not start, wait for the running
        jobs up to the shutdown timeout, cancel those still running, write the
        buffered completions."""
        assert self._abort is not None
        abort = self._abort
        until = time.monotonic() + ctx.options.shutdown_timeout.total_seconds()
        if abort.is_set():
            return
        await mode.stop_claiming(until)
        next_beat = time.monotonic() + ctx.options.heartbeat_interval
        while not abort.is_set():
            remaining = until - time.monotonic()
            if await mode.wait_idle(max(0.0, min(remaining, 0.05))) or remaining <= 0:
                break
            now = time.monotonic()
            mode.watch(now)
            if isinstance(mode, AsyncLeaseMode) and now >= next_beat:
                await mode.heartbeat()  # jobs still running keep their leases while we wait
                next_beat = now + ctx.options.heartbeat_interval
            if ctx.completer.due(now):
                await in_greenlet(ctx.completer.flush)
        if abort.is_set():
            return
        if mode.interrupt():
            await mode.wait_idle(_INTERRUPT_GRACE)
        await self._final_flush(ctx, until=max(until, time.monotonic() + 1.0))
        if mode.busy:
            log.warning("worker %s: stopped with %s", ctx.name, mode.describe_running())

    async def _final_flush(self, ctx: WorkerContext, *, until: float) -> None:
        """Before the worker stops: retry a failing write of completions until ``until``."""
        completer = ctx.completer
        while True:
            await in_greenlet(completer.flush)
            wait = (completer.deadline() or until) - time.monotonic()
            if not len(completer) or time.monotonic() + max(wait, 0) >= until:
                break
            await asyncio.sleep(max(wait, 0.0))
        if len(completer):
            log.error("worker %s: %s completions could not be written; their leases will expire and the "
                      "jobs run again", ctx.name, len(completer))

    # -- stop requests and signals -----------------------------------------------

    def _request_stop(self, *, now: bool) -> None:
        """In the loop: the first request is graceful, the next (or ``now``) immediate."""
        assert self._stopping is not None and self._abort is not None and self._wake is not None
        if now or self._stopping.is_set():
            self._abort.set()
        self._stopping.set()
        self._wake.set()

    def _signalled(self, name: str) -> None:
        assert self._stopping is not None
        if self._stopping.is_set():
            log.warning("worker %s: %s received again, stopping at once", self.name, name)
        else:
            log.info("worker %s: %s received, stopping: claimed jobs not started are handed back, running jobs "
                     "finish (a second signal stops at once)", self.name, name)
        self._request_stop(now=False)

    # -- parts -----------------------------------------------------------------

    def _context(self, own: Engine) -> WorkerContext:
        control = Control(sessionmaker(own, expire_on_commit=False),
                          sessionmaker(self._engine.sync_engine, expire_on_commit=False))
        return WorkerContext(
            options=self.options, name=self.name, tasks=self.tasks, repositories=self.repositories,
            sessions=control.sessions, job_sessions=JobSessions(control.sessions, hold=False), control=control,
            books=self._books,
            completer=Completer(self._books, control, sender=self, name=self.name, write_when_full=False),
            pacer=_pacer(self.options), sender=self,
        )

    def _thread_context(self, ctx: WorkerContext,
                        watch_connection: Callable[[Any], ConnectionWatch] | None) -> WorkerContext:
        """What sync handlers that take a session run with, in a thread: the
        same books, completer and pacer, and ``sync_bind``'s sessions for
        everything they write (a thread cannot use the async engine)."""
        assert self._sync_sessions is not None
        return WorkerContext(
            options=ctx.options, name=ctx.name, tasks=ctx.tasks, repositories=ctx.repositories,
            sessions=self._sync_sessions, job_sessions=JobSessions(self._sync_sessions, hold=False),
            control=Control(None, self._sync_sessions, [repo.table for repo in ctx.repositories]), books=ctx.books,
            completer=ctx.completer, pacer=ctx.pacer, sender=self, watch_connection=watch_connection,
        )

    async def _own_engine(self) -> Engine:
        """The worker's own autocommit pool: the sync face of one, on the async driver."""
        # The dialect initializes itself on its engine's first connection:
        # make that happen now, before two pools can race to it; within the
        # stall timeout, as a pooled connection's pre-ping may stall.
        stall = self.options.stall_timeout
        try:
            await asyncio.wait_for(_connect_once(self._engine), None if stall is None else stall.total_seconds())
        except Exception as exc:
            log.warning("worker %s: cannot connect yet (%r); the worker retries as it goes", self.name, exc)
        return worker_engine(self._engine.sync_engine, pool_size=CLAIMERS + 1, max_overflow=CLAIMERS + 1,
                             name=self.name)

    def _start_listener(self, mode: AsyncLeaseMode | AsyncTransactionMode) -> AsyncListener:
        channels = {repo.channel: "queue" for repo in self.repositories}
        if isinstance(mode, AsyncLeaseMode):
            channels.update({repo.cancel_channel: "cancel" for repo in self.repositories})
        connect = driver_connect(self._engine.sync_engine)

        def on_notify(channel: str, payload: str) -> None:
            if channels.get(channel) == "cancel":
                if payload.isdigit() and isinstance(mode, AsyncLeaseMode):
                    mode.cancel_notified(int(payload))
            elif payload in self.options.queues:
                self._on_notify_any()

        listener = AsyncListener(lambda: in_greenlet(connect), sorted(channels), on_notify=on_notify,
                                 on_connect=self._on_notify_any)
        listener.start()
        return listener

    def _on_notify_any(self) -> None:
        self._notified = True
        if self._wake is not None:
            self._wake.set()


async def _connect_once(engine: AsyncEngine) -> None:
    async with engine.connect():
        pass


async def _sleep(wake: asyncio.Event, seconds: float) -> None:
    """Sleep up to ``seconds``, or until ``wake`` is set; always let the other tasks run once."""
    if wake.is_set() or seconds <= 0:
        await asyncio.sleep(0)
        return
    timer = asyncio.get_running_loop().call_later(seconds, wake.set)
    try:
        await wake.wait()
    finally:
        timer.cancel()


def _pacer(options: WorkerOptions) -> Pacer:
    return Pacer(capacity=options.capacity, concurrency=options.concurrency, batch_size=options.batch_size,
                 poll_interval=options.poll_interval, claimers=CLAIMERS if options.mode == "lease" else 0)
