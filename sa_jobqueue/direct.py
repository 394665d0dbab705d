"""Direct statements: the library's own statements sent through the driver's cursor.

A short job's completion is one small statement, and SQLAlchemy's work
around it (the compiled cache lookup, an execution context, a result
object) cost as much Python as psycopg's sending and receiving it. A
:class:`DirectStatement` is compiled once per dialect and then executed on
the session's own DBAPI connection, in the session's transaction, so it
commits or rolls back with it exactly as before. An ``AsyncSession`` (run
in its greenlet, as ``run_sync`` does) has SQLAlchemy's DBAPI adapter of
psycopg's ``AsyncConnection`` or of asyncpg's connection as that connection:
its cursor is the one SQLAlchemy itself executes on (asyncpg's takes the
parameters in order, ``$1``, and its rows are made tuples). One thing
differs on asyncpg: the adapter's prepared-statement cache is cleared, after
a call of the dialect's schema-cache invalidation, at SQLAlchemy's next
statement on that connection rather than at this one's.

It falls back to ``Connection.execute`` whenever skipping SQLAlchemy could
be seen: a connection of another driver, a statement whose
returned columns need a type's result processor, an engine with ``echo`` or with
listeners for ``before_cursor_execute``, ``after_cursor_execute`` or
``handle_error`` other than the worker's own (SQL logging, tracing, error translation see every
statement, as they always did), a connection with a
``schema_translate_map``. The worker's own statement listeners (the asyncio
watchdog's, which only mark a statement in flight and are named so by the
attribute :data:`MARKS_ONLY`) are no reason to fall back: a direct
statement calls them itself, before and after it, as SQLAlchemy would. Parameters go through their types' bind
processors, as SQLAlchemy sends them; on psycopg an array of integers or UUIDs
(a batch's ids and lock tokens) in psycopg's binary format, the same value
at a fraction of the client's work. A driver error is raised as SQLAlchemy
would raise it (:class:`sqlalchemy.exc.DBAPIError` with the driver's
error as ``orig``), and a disconnect invalidates the connection.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg
from sqlalchemy import ARRAY, Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import AdaptedConnection, Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import Executable

# The worker's own ``handle_error`` (connections.discard_fatal) lives there; it
# changes only the errors of the worker's own engines. Named, not imported:
# this module stays a leaf of the imports.
_OWN_LISTENERS = "sa_jobqueue.connections"

#: Set (to True) on a ``before_cursor_execute`` (registered with
#: ``retval=True``) or ``after_cursor_execute`` listener that neither reads
#: nor changes a statement, only marks that one is in flight: a direct
#: statement runs it itself instead of falling back to SQLAlchemy.
MARKS_ONLY = "_sa_jobqueue_marks_only"

_Listeners = tuple[tuple[Callable[..., Any], ...], tuple[Callable[..., Any], ...]]
_UNMARKED: _Listeners = ((), ())


@dataclass(frozen=True)
class _Compiled:
    """A statement compiled for one dialect and one set of parameter names."""

    sql: str
    values: dict[str, Any]  # what the statement binds itself (a ``values(status='done')``)
    convert: dict[str, Callable[[Any], Any]]  # the types' bind processors, by parameter (a JSON column's)
    positions: tuple[str, ...] | None  # the parameters in order, for a positional paramstyle (asyncpg's $1)


class DirectStatement:
    """One statement of the library, executed directly where nothing would notice."""

    def __init__(self, statement: Executable, *, results: Sequence[Any] = ()) -> None:
        """``results``: the types of the columns it returns, so that one
        whose type converts values read from the driver (an ``Enum``, a
        ``TypeDecorator``) sends it through SQLAlchemy."""
        self.statement = statement
        self.results = list(results)
        # By dialect and parameter names (an INSERT's columns are its
        # parameters'); None when it needs SQLAlchemy.
        self._compiled: dict[tuple[Dialect, tuple[str, ...]], _Compiled | None] = {}

    def connection(self, session: Session) -> Connection:
        """The connection of ``session`` that ``session.execute`` would pick for this statement."""
        return session.connection(bind_arguments={"clause": self.statement})

    def rows(self, connection: Connection, params: Mapping[str, Any], *,
             encoded: Mapping[str, Any] | None = None) -> Sequence[Any]:
        """Execute on ``connection`` (in its current transaction) and return all rows, as tuples.
        ``encoded``: parameters already as their types' bind processors make them (a JSON
        value's text), sent as they are when the statement goes straight to the driver;
        through SQLAlchemy their ``params`` value is sent, processed."""
        dbapi_connection = connection.connection.dbapi_connection
        marks = _marks(connection) if _drivable(dbapi_connection) else None
        direct = self._direct(connection, params) if marks is not None else None
        if direct is None:
            return connection.execute(self.statement, params).all()
        assert dbapi_connection is not None and marks is not None
        sent = {**direct.values, **params} if direct.values else dict(params)
        for name, convert in direct.convert.items():
            if encoded is None or name not in encoded:
                sent[name] = convert(sent[name])
        if encoded:
            sent.update(encoded)
        before, after = marks
        cursor = dbapi_connection.cursor()
        try:
            for mark in before:
                mark(connection, cursor, direct.sql, sent, None, False)
            if direct.positions is None:
                cursor.execute(direct.sql, sent)
                rows: Sequence[Any] = cursor.fetchall()
            else:
                cursor.execute(direct.sql, tuple(sent[name] for name in direct.positions))
                rows = [tuple(row) for row in cursor.fetchall()]  # asyncpg's Records
            for mark in after:  # as SQLAlchemy: only once the statement returned
                mark(connection, cursor, direct.sql, sent, None, False)
            return rows
        except connection.dialect.loaded_dbapi.Error as exc:  # the adapters' errors (asyncpg's translated)
            raise _wrapped(connection, direct.sql, sent, exc, cursor) from exc
        finally:
            cursor.close()

    def _direct(self, connection: Connection, params: Mapping[str, Any]) -> _Compiled | None:
        if connection.engine.echo:
            return None
        if connection.get_execution_options().get("schema_translate_map"):
            return None  # the schema is chosen at execution
        key = connection.dialect, tuple(params)
        try:
            return self._compiled[key]
        except KeyError:
            dialect = connection.dialect
            converts = any(_reads(kind, dialect) for kind in self.results)
            compiled = self._compiled[key] = None if converts else _compile(self.statement, dialect, key[1])
            return compiled


def _drivable(dbapi_connection: Any) -> bool:
    """Whether ``dbapi_connection`` is psycopg 3's (sync), or SQLAlchemy's DBAPI adapter of
    psycopg's ``AsyncConnection`` or of asyncpg's connection (an ``AsyncSession``'s, run in
    its greenlet: the adapter's cursor awaits the driver)."""
    if isinstance(dbapi_connection, psycopg.Connection):
        return True
    if not isinstance(dbapi_connection, AdaptedConnection):
        return False
    raw = dbapi_connection.driver_connection
    # asyncpg by module: it is imported only by applications that use it.
    return isinstance(raw, psycopg.AsyncConnection) or type(raw).__module__.split(".")[0] == "asyncpg"


def _marks(connection: Connection) -> _Listeners | None:
    """The statement listeners a direct statement on ``connection`` runs
    itself (those named :data:`MARKS_ONLY`: before, after), or None when
    listeners would see (or change) its statements. The worker's own
    ``handle_error`` does not count: it changes only the errors of the
    worker's own engines."""
    dispatch: Any = connection.dispatch
    before, after = dispatch.before_cursor_execute, dispatch.after_cursor_execute
    marks = _UNMARKED
    if before or after:
        marks = tuple(before), tuple(after)
        if not all(getattr(listener, MARKS_ONLY, False) for listener in (*marks[0], *marks[1])):
            return None
    handlers: Any = connection.dialect.dispatch.handle_error
    if any(getattr(handler, "__module__", None) != _OWN_LISTENERS for handler in handlers):
        return None
    return marks


def _compile(statement: Executable, dialect: Dialect, names: tuple[str, ...]) -> _Compiled | None:
    """``statement`` compiled for ``dialect`` and parameters ``names``; None
    when a parameter is rendered at execution (a list expanded into ``IN``)."""
    if dialect.paramstyle not in ("pyformat", "numeric_dollar"):
        return None
    compiled = statement.compile(dialect=dialect, column_keys=list(names))  # type: ignore[attr-defined]
    convert: dict[str, Callable[[Any], Any]] = {}
    for bind in compiled.binds.values():
        if bind.expanding or bind.literal_execute:
            return None
        processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if processor is not None:
            convert[compiled.bind_names[bind]] = processor
    values = {name: value for name, value in compiled.params.items() if name not in names}
    positions = None if dialect.paramstyle == "pyformat" else tuple(compiled.positiontup or ())
    sql = str(compiled.string)
    if dialect.driver == "psycopg":  # sync and async: both take psycopg's placeholders
        for bind in compiled.binds.values():
            if _binary_array(bind.type):
                name = compiled.bind_names[bind]
                sql = sql.replace(f"%({name})s", f"%({name})b")
    return _Compiled(sql, values, convert, positions)


def _binary_array(kind: Any) -> bool:
    """Whether a parameter of the type ``kind`` goes to psycopg in its binary format: an array of
    integers or UUIDs (a batch's ids and lock tokens), which psycopg dumps several times faster
    than as an array literal, to the same value (the statement casts it to its column's type)."""
    if not isinstance(kind, ARRAY):
        return False
    try:
        item = kind.item_type.python_type
    except NotImplementedError:
        return False
    return item is int or item is UUID


def _reads(kind: Any, dialect: Dialect) -> bool:
    """Whether SQLAlchemy converts values of the type ``kind`` as it reads them."""
    return kind.dialect_impl(dialect).result_processor(dialect, None) is not None


def _wrapped(connection: Connection, sql: str, params: Mapping[str, Any], exc: Exception,
             cursor: Any) -> BaseException:
    """``exc`` as SQLAlchemy raises a driver's error; a disconnect invalidates ``connection``."""
    dialect = connection.dialect
    disconnect = dialect.is_disconnect(exc, connection.connection.dbapi_connection, cursor)  # type: ignore[arg-type]
    wrapped = sa_exc.DBAPIError.instance(
        sql, dict(params), exc, dialect.loaded_dbapi.Error, hide_parameters=connection.engine.hide_parameters,
        connection_invalidated=disconnect, dialect=dialect,
    )
    if disconnect:
        connection.invalidate(exc)
    return wrapped
