"""AsyncWatchdog: frees the asyncio worker's connections stalled behind a half-open path.

The thread worker's :mod:`~sa_jobqueue.watchdog`, for the event loop. A
connection can stall with a statement in flight (a proxy, pooler or NAT in
between stops forwarding while still acknowledging TCP): the coroutine that
awaits it then waits forever, be it a job, a claim or the worker's own
loop, and asyncpg has no TCP keepalives to notice even a vanished peer.

What is watched: the statements of the worker's own engine (claims,
heartbeats, reaps, completions), and those of the connection a job or a
batch holds on the application's engine, while it holds it
(:meth:`AsyncWatchdog.watch_job`); never the application's other
connections. A statement is in flight from SQLAlchemy's
``before_cursor_execute`` to its ``after_cursor_execute``, or, when it
raised, to the next statement, a ``ROLLBACK``, the connection's return to
the pool or the job's end; the worker marks the ``COMMIT`` of a job's, or
a batch's, transaction with :meth:`JobWatch.in_flight`. The listeners are
registered once, on the worker's own engine and, while the worker runs, on
the application's: a statement of a connection no job holds costs them one
lookup in its connection's ``info``. (Listeners added and removed per job,
on the job's ``Connection`` alone, cost about 50 µs per job on psycopg,
and the session drain measured 0.8x with them: docs/asyncio.md.) They only
mark statements, and say so (:data:`sa_jobqueue.direct.MARKS_ONLY`): the
library's statements sent straight through the driver (a claim, a
completion, an enqueue) call them themselves instead of taking SQLAlchemy's
slower path because a listener is there.

The judgment is the thread watchdog's (:mod:`sa_jobqueue.stalls`): every
``interval`` the watchdog's task looks at the statements in flight for
``after`` seconds, and reads their backends' state in ``pg_stat_activity``
over a connection of its own (made as the application's engine makes its
connections); a backend idle on the server for as long, in two checks in a
row of the same statement, is stalled. The watchdog terminates that
backend, and breaks the client's side of the connection (psycopg: its
socket is shut down; asyncpg: ``Connection.terminate()``), so that the
awaiting call fails as a disconnect and the caller's usual error paths take
over. A statement judged after a job raised mid-statement and went on
without its session (no rollback, no other statement) is in a transaction
that can no longer commit: ending it fails the attempt that would have
failed anyway, with a disconnect for its error.

What a caller may rely on: a statement running on the server is never
interrupted, however long it takes; a backend the server does not list
(behind PgBouncer) is never acted upon; a connection is broken only while
the statement judged stalled is still in flight, decided and done in one
step of the event loop that owns the connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..connections import driver_backend_pid, driver_connect, raw_connect
from ..direct import MARKS_ONLY
from ..inflight import ConnectionWatch
from ..sockets import shutdown_socket
from ..stalls import is_stalled, suspects
from ..watchdog import WATCHDOG_APPLICATION_NAME, Watchdog
from .bridge import in_greenlet
from .listener import close_quietly

log = logging.getLogger("sa_jobqueue.worker")

__all__ = ["AsyncWatchdog", "JobWatch", "WorkerWatch", "not_watched"]

_STATES = {
    "psycopg": "SELECT pid, state, extract(epoch FROM now() - state_change)::float8 "
               "FROM pg_stat_activity WHERE pid = ANY(%s)",
    "asyncpg": "SELECT pid, state, extract(epoch FROM now() - state_change)::float8 "
               "FROM pg_stat_activity WHERE pid = ANY($1::int[])",
}
_TERMINATE = {"psycopg": "SELECT pg_terminate_backend(%s)", "asyncpg": "SELECT pg_terminate_backend($1)"}
_NAME = {"psycopg": "SELECT set_config('application_name', %s, false)",
         "asyncpg": "SELECT set_config('application_name', $1, false)"}


@dataclass(eq=False)
class _Record:
    """A watched connection (see :class:`sa_jobqueue.stalls.InFlight`), read
    and written in the event loop's thread only."""

    pid: int
    sever: Callable[[], None] = field(repr=False)  # breaks the client's side; only while a statement is in flight
    since: float | None = None
    statement: int = 0
    idle_checks: int = 0

    def started(self) -> None:
        self.statement += 1
        self.idle_checks = 0
        self.since = time.monotonic()

    def ended(self) -> None:
        self.since = None


def _record(driver_connection: Any) -> _Record | None:
    """A record for a driver connection, or None when it cannot be watched."""
    pid = driver_backend_pid(driver_connection)
    if pid is None:
        return None
    terminate = getattr(driver_connection, "terminate", None)
    if callable(terminate):  # asyncpg: closes its transport; the awaiting call fails
        return _Record(pid, terminate)
    fileno = getattr(driver_connection, "fileno", None)
    if callable(fileno):  # psycopg: shut down, not closed; the awaiting read fails
        fd = fileno()
        return _Record(pid, lambda: shutdown_socket(fd))
    return None


def _info(conn: Any) -> dict[Any, Any] | None:
    """A Connection's ``info``, None once it was invalidated or closed (reading
    it then would reconnect, or raise: a ROLLBACK after a disconnect)."""
    if conn.invalidated or conn.closed:
        return None
    info: dict[Any, Any] = conn.info
    return info


class JobWatch:
    """A job's hold on its watched connection, until :meth:`release`."""

    def __init__(self, watchdog: AsyncWatchdog | None, info: Any = None, record: _Record | None = None) -> None:
        self._watchdog = watchdog
        self._info = info  # the held connection's info, where the watchdog's listeners find the record
        self._record = record

    def in_flight(self) -> JobWatch:
        """Watch a ``COMMIT``: ``with watch.in_flight(): await session.commit()``."""
        return self

    def __enter__(self) -> None:
        if self._record is not None:
            self._record.started()

    def __exit__(self, *exc_info: object) -> None:
        if self._record is not None:
            self._record.ended()

    def release(self) -> None:
        """Stop watching; call it before the connection goes back to the pool."""
        record, self._record = self._record, None
        if record is not None and self._watchdog is not None:
            record.ended()
            self._watchdog._unwatch_job(self._info, record)


#: The watch of a connection that is not watched (no watchdog, or a driver it cannot break).
NOT_WATCHED = JobWatch(None)

class AsyncWatchdog:
    """A task that frees stalled connections (see the module docstring).

    ``connect`` is awaited for each check (only when a statement is
    suspect) and returns a driver connection of its own, closed after;
    ``driver`` is ``"psycopg"`` or ``"asyncpg"``. A check that takes longer
    than ``check_timeout`` seconds, connect included, is given up, logged,
    and tried again at the next interval.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        *,
        driver: str,
        after: float,
        interval: float = 1.0,
        check_timeout: float = 5.0,
        application_name: str = WATCHDOG_APPLICATION_NAME,
    ) -> None:
        if driver not in _STATES:
            raise ValueError(f"driver must be one of {sorted(_STATES)}, got {driver!r}")
        self._connect = connect
        self._driver = driver
        self._after = after
        self._interval = interval
        self._check_timeout = check_timeout
        self._application_name = application_name
        self._key = object()  # this watchdog's entry in each own connection's info
        self._job_key = object()  # its entry in the info of a connection a job holds, while it holds it
        self._records: weakref.WeakSet[_Record] = weakref.WeakSet()
        #: Backends terminated so far (for logs and tests).
        self.freed = 0
        #: Looks at the watched statements completed so far (for tests).
        self.looks = 0

    # -- what is watched ------------------------------------------------------

    def watch_engine(self, engine: Engine) -> Callable[[], None]:
        """Watch every statement of ``engine`` (the worker's own, the sync
        face of an async-adapted pool) until the returned function is called."""

        def record_of(conn: Any) -> _Record | None:
            info = _info(conn)
            if info is None:
                return None
            if self._key not in info:  # once per DBAPI connection: the record lives with it
                made = info[self._key] = _record(conn.connection.driver_connection)  # None: not watchable
                if made is not None:
                    self._records.add(made)
            record: _Record | None = info[self._key]
            return record

        def checkin(dbapi_connection: Any, connection_record: Any) -> None:
            record = None if connection_record is None else connection_record.info.get(self._key)
            if record is not None:
                record.ended()  # a statement that raised: its caller gave the connection back

        unlisten = self._listen(engine, record_of)
        event.listen(engine.pool, "checkin", checkin)

        def unwatch() -> None:
            unlisten()
            event.remove(engine.pool, "checkin", checkin)

        return unwatch

    def watch_jobs(self, engine: Engine) -> Callable[[], None]:
        """Watch the statements of ``engine``'s connections (the application's,
        its sync face) that a job holds, from :meth:`watch_job` to the watch's
        release, until the returned function is called. For every other
        statement of the engine the listeners return after one lookup."""
        def record_of(conn: Any) -> _Record | None:
            info = _info(conn)
            return None if info is None else info.get(self._job_key)

        return self._listen(engine, record_of)

    def watch_job(self, connection: AsyncConnection, driver_connection: Any) -> JobWatch:
        """Watch the statements of the connection a job (or a batch) holds on
        the engine given to :meth:`watch_jobs`, until the watch is released."""
        record = _record(driver_connection)
        if record is None:
            return NOT_WATCHED
        info = connection.info
        info[self._job_key] = record
        self._records.add(record)
        return JobWatch(self, info, record)

    def _unwatch_job(self, info: dict[Any, Any], record: _Record) -> None:
        self._records.discard(record)
        if info.get(self._job_key) is record:
            del info[self._job_key]

    @staticmethod
    def _listen(engine: Engine, record_of: Callable[[Any], _Record | None]) -> Callable[[], None]:
        """Statement events on ``engine`` (and the return of a connection to
        its pool) marking the statements of the connections ``record_of``
        finds a record for; returns the undo."""

        def before(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> tuple[str, Any]:
            record = record_of(conn)
            if record is not None:
                record.started()
            return statement, parameters  # unchanged (retval=True, so that SQLAlchemy keeps it unwrapped)

        def ended(conn: Any, *_: Any) -> None:
            record = record_of(conn)
            if record is not None:
                record.ended()  # a reply, a ROLLBACK after a statement that raised

        # They only mark statements in flight: the library's direct statements
        # run them themselves rather than take SQLAlchemy's slower path.
        setattr(before, MARKS_ONLY, True)
        setattr(ended, MARKS_ONLY, True)
        listeners: list[tuple[Any, str, Callable[..., Any], dict[str, bool]]] = [
            (engine, "before_cursor_execute", before, {"retval": True}),
            (engine, "after_cursor_execute", ended, {}), (engine, "rollback", ended, {}),
        ]
        for target, name, fn, options in listeners:
            event.listen(target, name, fn, **options)

        def unlisten() -> None:
            for target, name, fn, _ in listeners:
                event.remove(target, name, fn)

        return unlisten

    # -- the task -----------------------------------------------------------------

    async def run(self) -> None:
        """Look every ``interval`` seconds until cancelled; never raises otherwise."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                found = suspects(list(self._records), now=time.monotonic(), after=self._after)
                if found:
                    await asyncio.wait_for(self._check(found), self._check_timeout)
            except asyncio.TimeoutError:
                log.warning("watchdog: a check took longer than %.1f s; looking again", self._check_timeout)
            except Exception:  # never let the watchdog die
                log.exception("watchdog: check failed")
            self.looks += 1

    async def _check(self, found: list[tuple[_Record, int, float]]) -> None:
        conn = await self._connect()
        try:
            await self._query(conn, _NAME, self._application_name)
            rows = await self._query(conn, _STATES, sorted({record.pid for record, _, _ in found}))
            states = {int(pid): (str(state), float(age or 0.0)) for pid, state, age in rows}
            for record, statement, since in found:
                state, age = states.get(record.pid, ("unknown", 0.0))
                if not is_stalled(record, statement, state=state, age=age, after=self._after):
                    continue
                log.warning("watchdog: backend %s waited on for %.0f s but %s on the server: the connection is "
                            "stalled; terminating it", record.pid, time.monotonic() - since, state)
                try:
                    await self._query(conn, _TERMINATE, record.pid)
                except Exception as exc:
                    log.warning("watchdog: could not terminate backend %s: %s", record.pid, exc)
                # Decided and done in one step of the loop: the same statement is
                # still in flight, so the connection is still open and the job's.
                if record.statement == statement and record.since is not None:
                    record.since = None
                    record.sever()
                self.freed += 1
        finally:
            await close_quietly(conn)

    async def _query(self, conn: Any, queries: dict[str, str], param: Any) -> list[Any]:
        if self._driver == "asyncpg":
            return list(await conn.fetch(queries["asyncpg"], param))
        cursor = await conn.execute(queries["psycopg"], (param,))
        return list(await cursor.fetchall())


def not_watched(connection: AsyncConnection, driver_connection: Any) -> JobWatch:
    """:meth:`AsyncWatchdog.watch_job` of a worker without a watchdog."""
    return NOT_WATCHED


class WorkerWatch:
    """A worker's watchdogs from start to stop: ``watch_job`` for its
    executors, ``watch_connection`` for the thread context of its sync
    handlers that take a session (a thread :class:`~sa_jobqueue.watchdog.Watchdog`
    on ``sync_engine``, psycopg only), ``await stop()`` when the worker
    ends. ``after`` None: no watchdog, and nothing is watched (nor on a
    driver a watchdog cannot watch)."""

    def __init__(self, engine: AsyncEngine, own: Engine, after: float | None,
                 sync_engine: Engine | None = None) -> None:
        self.watch_job: Callable[[AsyncConnection, Any], JobWatch] = not_watched
        self.watch_connection: Callable[[Any], ConnectionWatch] | None = None
        self._task: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] = lambda: None
        self._threaded: Watchdog | None = None
        if after is None:
            return
        if sync_engine is not None and sync_engine.dialect.driver == "psycopg":
            self._threaded = Watchdog(raw_connect(sync_engine), after=after)
            self.watch_connection = self._threaded.watch_jobs()
            self._threaded.start()
        driver = engine.dialect.driver
        if driver not in _STATES:
            return
        connect = driver_connect(engine.sync_engine)
        watchdog = AsyncWatchdog(lambda: in_greenlet(connect), driver=driver, after=after)
        unwatch_own, unwatch_jobs = watchdog.watch_engine(own), watchdog.watch_jobs(engine.sync_engine)

        def unwatch() -> None:
            unwatch_own()
            unwatch_jobs()

        self._unwatch = unwatch
        self.watch_job = watchdog.watch_job
        self._task = asyncio.get_running_loop().create_task(watchdog.run(), name="sa_jobqueue-watchdog")

    async def stop(self) -> None:
        self._unwatch()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._threaded is not None:
            await asyncio.to_thread(self._threaded.stop)  # joins its thread: not on the loop
