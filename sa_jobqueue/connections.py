"""Connections made the way the application's engine makes them.

A worker opens connections of its own: a pool for its own statements
(claims, heartbeats, reaps, batched completions), one connection for its
listener's LISTEN, and short ones for its watchdog's checks. Each must
connect exactly as the application's :class:`~sqlalchemy.engine.Engine`
does: the same ``connect_args`` (SSL settings, ``options``, timeouts), the
same ``creator`` (an IAM token function, say), the same ``do_connect`` and
pool ``connect`` events, the same dialect options (``json_serializer``,
``json_deserializer``, ``isolation_level``...). Rebuilding a conninfo
string from the engine's URL loses all of these.

How, and why this way (SQLAlchemy 2.x):

* :meth:`Pool.recreate() <sqlalchemy.pool.Pool.recreate>` returns a new,
  empty pool of the same class with the same creator and settings, and its
  event listeners: :meth:`Engine.dispose() <sqlalchemy.engine.Engine.dispose>`
  documents that the pool events "are transferred to the new pool", and
  relies on it. The creator is the function ``create_engine`` built from the
  URL and ``connect_args`` (which runs the dialect's ``do_connect`` events),
  or the user's ``creator``; the transferred listeners include the dialect's
  own set-up (``on_connect``, the ``first_connect`` that initializes the
  dialect) and the application's ``connect``/``checkout`` events. The two
  pools keep separate listener lists: a listener added to the new pool never
  reaches the application's. (One coupling remains: removing one of the
  application's listeners later also removes it from the copy, since both
  share its registration.) The copy is a snapshot: listeners the application
  adds after it was made are not in it.
* :func:`raw_connect` checks a connection out of such a private copy and
  :meth:`detaches <sqlalchemy.pool.PoolProxiedConnection.detach>` it at once:
  every creator and listener ran, the pool forgets the connection (its slot
  is free again) and the caller owns a plain DBAPI connection. A detached
  connection is not closed when its proxy is garbage collected.
* :func:`worker_engine` puts those connections into a
  :class:`~sqlalchemy.pool.QueuePool` of its own (``pool_size`` and
  ``max_overflow`` of the caller's choosing; ``Pool`` and its ``creator``,
  ``dialect`` arguments are documented for building a pool by hand), under
  an :class:`~sqlalchemy.engine.Engine` that shares the application's
  dialect object. ``Engine`` is documented as "instantiated publicly using
  create_engine()", but its constructor ``Engine(pool, dialect, url, ...)``
  is public and not underscored, and it is what ``create_engine`` calls.
  ``create_engine(url, pool=...)`` was the alternative and is worse: it
  builds a *new* dialect from the URL alone (the application's
  ``json_serializer``, ``isolation_level`` and other dialect arguments are
  lost, they are not recoverable from the engine) and registers that
  dialect's ``on_connect`` a second time on the pool. Using the recreated
  pool itself as the worker's pool would keep the application's
  ``pool_size``, which cannot be changed after construction.

The worker's pool fires only its own pool events (the application's ran
once, when the connection was made, on the private copy), and engine-level
events of the application (``before_cursor_execute``...) are not copied.
:meth:`Engine.dispose` of the worker engine closes the worker's connections
only; the application's pool is never touched.

Errors that end a connection
----------------------------

A connection that reports a read-only transaction (SQLSTATE 25006: after a
failover, or when ``default_transaction_read_only`` is on), an
administrator's or the server's shutdown (57P01, 57P02, 57P03), or that was
lost, stays useless: reused from the pool it fails again. The worker engine
discards such a connection: a ``handle_error`` listener marks these errors
as disconnects (:attr:`ExceptionContext.is_disconnect
<sqlalchemy.engine.ExceptionContext.is_disconnect>`), so SQLAlchemy
invalidates the connection and, as for any disconnect, recycles the pool's
other connections made before it at their next checkout. The statement that
hit the error still fails; the next checkout connects afresh.

``handle_error`` is a dialect event since SQLAlchemy 2.0: listening on an
engine registers on its *dialect*, which the worker engine shares with the
application's engine. So the listener is registered once per dialect and
acts only on errors of engines made by :func:`worker_engine` (it finds them
by an execution option); the application's own connections keep
SQLAlchemy's behaviour. Job sessions run on the application's engine: the
worker discards their connections itself (see :func:`is_fatal_to_connection`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Connection, event
from sqlalchemy.engine import Dialect, Engine, ExceptionContext
from sqlalchemy.pool import AsyncAdaptedQueuePool, QueuePool

from .errors import InvalidArgumentError

__all__ = [
    "backend_pid", "driver_backend_pid", "driver_connect", "is_fatal_to_connection", "own_session", "raw_connect",
    "worker_engine",
]

#: An execution option set on every worker engine: the mark that the shared
#: dialect's ``handle_error`` listener goes by. Its value is the engine's name.
WORKER_ENGINE_OPTION = "sa_jobqueue_worker_engine"

# SQLSTATEs after which a connection is of no further use.
_FATAL_SQLSTATES = frozenset({
    "25006",  # read_only_sql_transaction: a standby, or default_transaction_read_only
    "25P03",  # idle_in_transaction_session_timeout: the server ended the session
    "25P04",  # transaction_timeout (PostgreSQL 17): the server ended the session
    "57P01",  # admin_shutdown: pg_terminate_backend, or a smart/fast shutdown
    "57P02",  # crash_shutdown: another backend crashed, the server restarts
    "57P03",  # cannot_connect_now: starting up, in recovery
    "57P04",  # database_dropped
    "57P05",  # idle_session_timeout
})

_install_lock = threading.Lock()

log = logging.getLogger("sa_jobqueue.worker")

T = TypeVar("T")


def is_fatal_to_connection(exc: BaseException) -> bool:
    """Whether ``exc`` means that the connection it came from cannot be used again.

    True for a psycopg error with SQLSTATE 25006 (read-only transaction),
    25P03/25P04 (the server's transaction timeouts, which end the session),
    57P01-57P05 (shutdowns, recovery, dropped database, idle session
    timeout) or of class 08 (connection exception), and for a
    :class:`psycopg.OperationalError` without a SQLSTATE (raised by the
    client: the connection was lost or closed), except a pipeline abort.
    The same rules hold for asyncpg's errors (and SQLAlchemy's adapter
    around them, which keeps their SQLSTATE); an asyncpg ``InterfaceError``
    or ``ConnectionDoesNotExistError`` (the client's: a closed connection)
    is fatal too. False for everything else, including the OperationalErrors a healthy
    connection reports (a statement timeout, a lock timeout, a deadlock or a
    serialization failure). ``exc`` may be the psycopg error itself, a
    SQLAlchemy error wrapping it (``.orig``), or any exception whose
    ``__cause__`` chain leads to one; the first psycopg error found decides.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, psycopg.Error):
            state = current.sqlstate
            if state is None:
                return isinstance(current, psycopg.OperationalError) and not isinstance(
                    current, psycopg.errors.PipelineAborted
                )
            return state in _FATAL_SQLSTATES or state.startswith("08")
        if _is_asyncpg_error(current):
            state = getattr(current, "sqlstate", None)
            if isinstance(state, str):
                return state in _FATAL_SQLSTATES or state.startswith("08")
            # Raised by the client: the connection is closed, or in a state no statement can follow.
            return type(current).__name__ in ("InterfaceError", "ConnectionDoesNotExistError")
        # Look at the cause last: .orig is SQLAlchemy's own link to the DBAPI error.
        if current.__cause__ is not None:
            pending.append(current.__cause__)
        orig = getattr(current, "orig", None)
        if isinstance(orig, BaseException):
            pending.append(orig)
    return False


def send_on_own(connection: Connection, send: Callable[[Connection], T]) -> T:
    """Run ``send`` on ``connection``, an autocommit connection of a worker
    engine, its statements sent straight to the driver (a claim, a batch of
    completions). SQLAlchemy's record of a transaction is then ended
    (committed; rolled back after an error), so the next use starts as this
    one did. An error that makes the connection unusable (see
    :func:`is_fatal_to_connection`; or one not an ``Exception``) invalidates
    it, as the engine's ``handle_error``, which such statements pass, would
    have; the error is raised."""
    try:
        result = send(connection)
    except BaseException as exc:
        if (not isinstance(exc, Exception) or is_fatal_to_connection(exc)) and not connection.invalidated:
            connection.invalidate(exc)
        _end_transaction(connection, commit=False)
        raise
    _end_transaction(connection, commit=True)
    return result


def _end_transaction(connection: Connection, *, commit: bool) -> None:
    """End SQLAlchemy's record of a transaction on an autocommit connection
    (nothing is pending: each statement committed at once)."""
    if not connection.in_transaction():
        return
    try:
        connection.commit() if commit else connection.rollback()
    except Exception:  # an unusable connection: its keeper replaces it, its pool discards it
        log.debug("worker: ending a transaction on its own connection failed", exc_info=True)


def _is_asyncpg_error(exc: BaseException) -> bool:
    """An error of asyncpg, or of SQLAlchemy's adapter around it (which keeps its ``sqlstate``)."""
    module = type(exc).__module__
    return module.startswith("asyncpg") or module == "sqlalchemy.dialects.postgresql.asyncpg"


def raw_connect(engine: Engine) -> Callable[[], psycopg.Connection[Any]]:
    """A factory of psycopg connections made exactly as ``engine`` makes its own.

    Each call returns a new :class:`psycopg.Connection` that the caller owns
    and must close: it belongs to no pool, and ``engine``'s pool is neither
    used nor counted. It was made by ``engine``'s creator (URL,
    ``connect_args``, ``do_connect`` events, or the ``creator`` argument) and
    went through the pool ``connect`` and ``checkout`` listeners ``engine``
    had when this function was called (see the module docstring). It comes
    in the state those leave it in, usually not in autocommit: see
    :func:`own_session`. A call raises what connecting raises (the driver's
    :class:`psycopg.OperationalError` when the server cannot be reached).

    Raises :class:`~sa_jobqueue.InvalidArgumentError` when ``engine`` does not
    use the psycopg 3 driver (``postgresql+psycopg://``, see
    :func:`~sa_jobqueue.psycopg_url`).
    """
    if not isinstance(engine, Engine):
        raise InvalidArgumentError("engine", "must be an Engine")
    if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
        raise InvalidArgumentError(
            "engine", f"must use the psycopg 3 driver (postgresql+psycopg://), not {engine.url.drivername}"
        )
    connect = _detached_connections(engine)

    def connect_psycopg() -> psycopg.Connection[Any]:
        conn = connect()
        if not isinstance(conn, psycopg.Connection):  # a creator returning something else
            conn.close()
            raise InvalidArgumentError("engine", f"made a {type(conn).__name__}, not a psycopg connection")
        return conn

    return connect_psycopg


def worker_engine(engine: Engine, *, pool_size: int, name: str, max_overflow: int = 0) -> Engine:
    """A new Engine for a worker's own statements, connected as ``engine`` is.

    What a caller may rely on:

    * its connections are made exactly as ``engine``'s (same creator,
      ``connect_args``, ``do_connect`` events, pool ``connect``/``checkout``
      listeners as of this call; see the module docstring), and it uses
      ``engine``'s dialect object, so dialect options apply too;
    * it has a pool of its own, a :class:`~sqlalchemy.pool.QueuePool` of
      ``pool_size`` connections plus up to ``max_overflow`` more; a checkout
      past that waits up to 30 s, then raises
      :class:`sqlalchemy.exc.TimeoutError`. Connections checked out of
      ``engine``'s pool, however many, never make it wait;
    * it runs in AUTOCOMMIT, with ``engine``'s other execution options:
      each connection is put in autocommit once, as it is made, not at
      every checkout (an ``isolation_level`` execution option would set it
      as each :class:`~sqlalchemy.engine.Connection` is built and reset it
      at each checkin: under asyncio that is an await inside
      ``Connection()``, and a task cancelled there loses the connection
      before anything can give it back);
    * a connection that fails with an error :func:`is_fatal_to_connection`
      accepts is invalidated, not returned to the pool (the failing call
      still raises);
    * its :meth:`~sqlalchemy.engine.Engine.dispose` closes its own
      connections only. Dispose of it when done: nothing else closes them.

    ``engine``'s engine-level events (``before_cursor_execute``...) are not
    copied, and ``engine``'s ``pool_pre_ping`` and ``pool_recycle`` do not
    apply: a dead connection costs one failed statement, then is replaced.
    ``name`` names the engine and its pool in SQLAlchemy's logs.
    """
    if not isinstance(engine, Engine):
        raise InvalidArgumentError("engine", "must be an Engine")
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise InvalidArgumentError("pool_size", f"must be a positive int, got {pool_size!r}")
    if isinstance(max_overflow, bool) or not isinstance(max_overflow, int) or max_overflow < 0:
        raise InvalidArgumentError("max_overflow", f"must be an int >= 0, got {max_overflow!r}")
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("name", f"must be a non-empty str, got {name!r}")
    # An async dialect (the sync face of an AsyncEngine) waits for a
    # connection without blocking the event loop only in the async-adapted pool.
    pool_class = AsyncAdaptedQueuePool if engine.dialect.is_async else QueuePool
    pool = pool_class(
        _autocommit(engine.dialect, _detached_connections(engine)), pool_size=pool_size,
        max_overflow=max_overflow, logging_name=name, dialect=engine.dialect,
    )
    options = {**engine.get_execution_options(), WORKER_ENGINE_OPTION: name}
    options.pop("isolation_level", None)  # each connection is in autocommit from the start
    own = Engine(
        pool, engine.dialect, engine.url, logging_name=name, echo=engine.echo,
        hide_parameters=engine.hide_parameters, execution_options=options,
    )
    with _install_lock:
        if not event.contains(engine.dialect, "handle_error", _discard_fatal):
            event.listen(engine.dialect, "handle_error", _discard_fatal)
    return own


def own_session(conn: psycopg.Connection[Any], application_name: str | None = None) -> None:
    """Turn a connection from :func:`raw_connect` into an autocommit session.

    A transaction that the engine's ``connect`` listeners left open is
    committed first (so the settings they made stay), a failed one rolled
    back. With ``application_name``, the session's ``application_name`` is
    set to it (one round trip), whatever the engine's connect arguments said.
    """
    status = conn.info.transaction_status
    if status == psycopg.pq.TransactionStatus.INTRANS:
        conn.commit()
    elif status == psycopg.pq.TransactionStatus.INERROR:
        conn.rollback()
    conn.autocommit = True
    if application_name is not None:
        conn.execute("SELECT set_config('application_name', %s, false)", (application_name,))


def driver_connect(engine: Engine) -> Callable[[], Any]:
    """A factory of the driver's own connections, made as ``engine`` makes its own.

    As :func:`raw_connect`, for any driver, and for the sync face of an
    ``AsyncEngine`` (``async_engine.sync_engine``): each call returns the
    connection under SQLAlchemy's DBAPI adapter (a
    :class:`psycopg.AsyncConnection` or an ``asyncpg.Connection`` under
    asyncio), owned by the caller. For an async engine, call it in
    SQLAlchemy's greenlet (``greenlet_spawn``), where its connect runs.
    """
    if not isinstance(engine, Engine):
        raise InvalidArgumentError("engine", "must be an Engine")
    return _detached_connections(engine, driver=True)


def _detached_connections(engine: Engine, *, driver: bool = False) -> Callable[[], Any]:
    """DBAPI connections (or, with ``driver``, the driver's own under them)
    from a private copy of ``engine``'s pool, detached at once."""
    source = engine.pool.recreate()
    # The copy has the application's pool size and timeout; a tiny pool
    # (pool_size=1, max_overflow=0, a short pool_timeout) would make
    # concurrent connects wait on each other and time out. One checkout at
    # a time never waits: the detach frees the slot before the next. Under
    # asyncio (an async dialect, connecting in SQLAlchemy's greenlet) a
    # thread lock held across the connect would block the event loop that
    # the connect waits on; there the async-adapted copy queues concurrent
    # connects itself, without blocking.
    lock: Any = contextlib.nullcontext() if engine.dialect.is_async else threading.Lock()

    def connect() -> Any:
        with lock:
            proxied = source.connect()
            connection = proxied.driver_connection if driver else proxied.dbapi_connection
            proxied.detach()
        return connection

    return connect


def _autocommit(dialect: Dialect, connect: Callable[[], Any]) -> Callable[[], Any]:
    """``connect``, its connections put in autocommit through ``dialect`` (as
    SQLAlchemy's ``isolation_level="AUTOCOMMIT"`` does); one that fails
    meanwhile, or whose task is cancelled, is closed, never left open."""

    def autocommit_connect() -> Any:
        connection = connect()
        try:
            dialect.set_isolation_level(connection, "AUTOCOMMIT")
        except BaseException:
            with contextlib.suppress(Exception):
                connection.close()
            raise
        return connection

    return autocommit_connect


def _discard_fatal(context: ExceptionContext) -> None:
    """The worker engines' ``handle_error``, installed on their dialect (see
    the module docstring); it leaves other engines' errors alone."""
    engine = context.engine
    if context.is_disconnect or context.connection is None or engine is None:
        return  # already a disconnect, a failed connect, or a pre-ping
    if engine.get_execution_options().get(WORKER_ENGINE_OPTION) is None:
        return  # the application's engine: SQLAlchemy's own rules apply
    if is_fatal_to_connection(context.original_exception):
        context.is_disconnect = True


def backend_pid(connection: Any) -> int | None:
    """The server process of a job's connection (a SQLAlchemy Connection), read in the thread that owns it."""
    return driver_backend_pid(connection.connection.driver_connection)


def driver_backend_pid(driver_connection: Any) -> int | None:
    """The server process of a driver's connection, known without a round trip:
    psycopg's (sync or async) ``info.backend_pid``, asyncpg's ``get_server_pid()``."""
    info = getattr(driver_connection, "info", None)
    pid = getattr(info, "backend_pid", None)
    if pid is None and callable(getattr(driver_connection, "get_server_pid", None)):
        pid = driver_connection.get_server_pid()
    return pid if isinstance(pid, int) else None
