"""AsyncJobSessions: a fresh AsyncSession per job, on a connection held while jobs wait.

The asyncio counterpart of :mod:`sa_jobqueue.worker.job_sessions`. Checking
a connection out of the pool for every job, setting its isolation level,
asking for its driver connection and giving it back costs an ``async def``
job with a session about a fifth of its client CPU (the AsyncSession's
greenlet bridge makes each step dearer than in a thread). So a lease-mode
asyncio worker keeps the connections its jobs gave back, READ COMMITTED,
for the next jobs, as long as claimed jobs wait for a slot (``jobs_wait``,
which the lease mode sets): a job that ends with none waiting gives its
connection back to the pool, and at the worker's end
:meth:`AsyncJobSessions.release_idle` gives back those kept for jobs that
never came (handed back at a stop), and any a job closes with after it.
Every job gets a **fresh** session.

What a handler may rely on, as in the thread worker:

* its session is new: nothing of an earlier job's session is seen by the
  next; it commits exactly once, with the job's fenced completion;
* its transaction is READ COMMITTED, whatever the engine's default;
* ``session.bind`` is the AsyncEngine, as in a session of its
  sessionmaker anywhere else: a session a handler opens on it is a session
  of its own, on another connection of the pool, and its commit commits.

Connections are kept only for a plain ``async_sessionmaker`` bound to one
AsyncEngine (the worker's when given one): one with ``binds``, or whose
sync session class overrides ``get_bind``, picks connections its own way
and gets one from its sessionmaker per job. A kept connection that an
error made unusable (invalidated, as a fatal error or a cancelled
statement leaves it) is given up, and the next job checks out a new one; a
kept connection meets ``pool_pre_ping`` and ``pool_recycle`` only once it
is back in the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from ..connections import driver_backend_pid
from ..worker.job_sessions import READ_COMMITTED

__all__ = ["AsyncJobSessions", "JobSession", "holds_connections"]


def holds_connections(sessions: async_sessionmaker[AsyncSession]) -> AsyncEngine | None:
    """The AsyncEngine whose connections the worker may keep for ``sessions``'
    jobs, or None when its sessions choose their connections themselves."""
    bind = sessions.kw.get("bind")
    if not isinstance(bind, AsyncEngine) or sessions.kw.get("binds"):
        return None
    sync_class = sessions.kw.get("sync_session_class") or getattr(sessions.class_, "sync_session_class", Session)
    if getattr(sync_class, "get_bind", None) is not Session.get_bind:
        return None
    return bind


@dataclass(eq=False)
class _Connection:
    """A connection with what a job needs to know of it, found once per checkout."""

    connection: AsyncConnection
    driver_connection: Any
    pid: int | None

    @property
    def usable(self) -> bool:
        return not (self.connection.invalidated or self.connection.closed)


@dataclass(eq=False)
class JobSession:
    """A job's (or a group's) session, its transaction begun on ``connection``."""

    session: AsyncSession
    connection: AsyncConnection
    driver_connection: Any  # for the watchdog, which breaks it when it stalls
    pid: int | None  # the server process, whose statement a cancel cancels
    _kept: _Connection | None  # the connection to keep or give back at the close, when it is held


class AsyncJobSessions:
    """The jobs' sessions of one asyncio worker (see the module docstring)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], *, hold: bool = True) -> None:
        self.sessions = sessions
        self._engine = holds_connections(sessions) if hold else None
        self._idle: list[_Connection] = []  # kept between jobs, most recently used last
        self._released = False  # the worker's end: nothing is kept any more
        self.jobs_wait: Callable[[], bool] = _never  # whether claimed jobs wait for a slot: keep connections

    async def open(self) -> JobSession:
        """A fresh session, its READ COMMITTED transaction begun. Raises what
        connecting raises (the pool's ``TimeoutError``, a refused connection,
        a cancel while it waits): nothing is held then."""
        if self._engine is None:
            session = self.sessions()
            try:
                connection = await session.connection(execution_options=READ_COMMITTED)
                raw = await connection.get_raw_connection()
            except BaseException:
                await session.close()
                raise
            driver = raw.driver_connection
            return JobSession(session, connection, driver, driver_backend_pid(driver), None)
        kept = await self._take()
        # Bound to the AsyncEngine as configured, its transaction begun on the
        # kept connection: ``session.bind`` stays the engine (bound to the
        # Connection, a session a handler opens on it would join this job's
        # transaction, and its commit would not commit).
        session = self.sessions()
        try:
            await session.connection(bind_arguments={"bind": kept.connection.sync_connection})
        except BaseException:
            await session.close()
            await self._give_back(kept)
            raise
        return JobSession(session, kept.connection, kept.driver_connection, kept.pid, kept)

    async def close(self, opened: JobSession) -> None:
        """Close the session (its transaction rolled back if still open); a
        held connection still usable is kept for the next job while jobs
        wait, and otherwise given back to the pool."""
        try:
            await opened.session.close()
        finally:
            kept = opened._kept
            if kept is not None:
                if kept.usable and self.jobs_wait() and not self._released:
                    self._idle.append(kept)
                else:
                    await self._give_back(kept)

    async def release_idle(self) -> None:
        """The kept connections go back to the pool (the worker's end), and
        from now on each connection a job closes with."""
        self._released = True
        idle, self._idle = self._idle, []
        for kept in idle:
            await self._give_back(kept)

    async def _take(self) -> _Connection:
        while self._idle:
            kept = self._idle.pop()
            if kept.usable:
                return kept
            await self._give_back(kept)
        assert self._engine is not None
        connection = await self._engine.connect()
        try:
            await connection.execution_options(**READ_COMMITTED)
            raw = await connection.get_raw_connection()
        except BaseException:
            await self._give_back(_Connection(connection, None, None))
            raise
        driver = raw.driver_connection
        return _Connection(connection, driver, driver_backend_pid(driver))

    async def _give_back(self, kept: _Connection) -> None:
        try:
            await kept.connection.close()
        except Exception:  # a broken connection: the pool discards it
            pass


def _never() -> bool:
    return False
