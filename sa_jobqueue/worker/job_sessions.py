"""JobSessions: a fresh session per job, on a connection its slot holds while it has work.

Checking a connection out of the pool for every job, setting its isolation
level and giving it back afterwards cost about a fifth of a short job's
Python time. So each slot thread of a lease-mode worker holds one
connection of the application's engine from its first job until it finds
no next job waiting (``Slots``' ``on_idle``), and every job in between gets
a **fresh** session bound to that connection, in a transaction of its own.

What a handler may rely on:

* its session is new: nothing of an earlier job's session (identity map,
  ``session.info``, listeners added to the session) is seen by the next;
  it commits exactly once, with the job's fenced completion;
* its transaction is READ COMMITTED, whatever the engine's default;
* ``session.get_bind()`` is the Engine, as in a session of its sessionmaker
  anywhere else, and ``session.connection()`` the slot's connection (a
  handler should not close it): a Session that a handler opens on
  ``session.get_bind()`` is independent of the job's transaction, on a
  connection of its own from the pool, and its commit commits.

A connection is held only from a plain ``sessionmaker`` bound to one Engine
(the Worker's own when given an Engine): one with ``binds`` or a Session
class that overrides ``get_bind`` picks connections its own way, and gets
one from its sessionmaker per job, as before. A held connection that an
error made unusable (:func:`~sa_jobqueue.connections.is_fatal_to_connection`
invalidates it) is given up, and the next job checks out a new one; an
idle slot's connection is back in the pool, where ``pool_pre_ping`` and
``pool_recycle`` apply at the next checkout.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.orm import Session, sessionmaker

from .held import HeldConnections

READ_COMMITTED = {"isolation_level": "READ COMMITTED"}


def read_committed_connection(session: Session, tables: Sequence[Table]) -> Connection:
    """Open ``session``'s connection to each of ``tables`` (one per distinct
    bind, chosen as the session's statements on that table choose it),
    READ COMMITTED; return the first table's. Call it first in a transaction.

    By table, so that it works for sessionmakers with per-table ``binds``
    too, whose sessions have no connection of their own to ask for."""
    first: Connection | None = None
    binds: list[object] = []
    for table in tables:
        bind = session.get_bind(clause=table)
        if any(bind is seen for seen in binds):
            continue
        binds.append(bind)
        connection = session.connection(bind_arguments={"clause": table}, execution_options=READ_COMMITTED)
        first = first or connection
    assert first is not None, "no table given"
    return first


def holds_connections(sessions: sessionmaker[Session]) -> Engine | None:
    """The Engine whose connections slots may hold for ``sessions``, or None
    when its sessions choose their connections themselves."""
    bind = sessions.kw.get("bind")
    if not isinstance(bind, Engine) or sessions.kw.get("binds"):
        return None
    if getattr(sessions.class_, "get_bind", None) is not Session.get_bind:
        return None
    return bind


class JobSessions:
    """The jobs' sessions of one worker, as its slot threads open them."""

    def __init__(self, sessions: sessionmaker[Session], *, hold: bool = True) -> None:
        """``hold``: slots hold connections (their threads call :meth:`release`
        when idle); without it every job checks out its own."""
        self.sessions = sessions
        engine = holds_connections(sessions) if hold else None
        self._held = HeldConnections(engine, **READ_COMMITTED) if engine is not None else None

    @property
    def held(self) -> int:
        """Connections the slots hold right now."""
        return self._held.held if self._held is not None else 0

    def open(self, table: Table) -> tuple[Session, Connection]:
        """A fresh session for this thread's next job (of the job table
        ``table``), its transaction begun, and its READ COMMITTED connection
        to ``table``. Raises what connecting raises (the pool's
        ``TimeoutError``, a refused connection): nothing is held then."""
        if self._held is None:
            session = self.sessions()
            try:
                session.begin()
                return session, read_committed_connection(session, [table])
            except BaseException:
                session.close()
                raise
        connection = self._held.connection()
        # Bound to the Engine as configured, its transaction begun on the
        # held connection: the session finds that connection under its
        # Engine for every statement, and ``get_bind()`` stays the Engine,
        # so a session a handler opens on it is a session of its own, on
        # another connection of the pool (bound to the held Connection, it
        # would join this job's transaction instead, and its commit would
        # not commit).
        session = self.sessions()
        try:
            session.begin()
            session.connection(bind_arguments={"bind": connection})
        except BaseException:
            session.close()
            raise
        return session, connection

    def release(self) -> None:
        """This thread's slot has no next job: its connection goes back to the pool."""
        if self._held is not None:
            self._held.release()
