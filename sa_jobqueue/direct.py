"""Direct statements: the library's own statements sent through psycopg's cursor.

A short job's completion is one small statement, and SQLAlchemy's work
around it (the compiled cache lookup, an execution context, a result
object) cost as much Python as psycopg's sending and receiving it. A
:class:`DirectStatement` is compiled once per dialect and then executed on
the session's own DBAPI connection, in the session's transaction, so it
commits or rolls back with it exactly as before.

It falls back to ``Connection.execute`` whenever skipping SQLAlchemy could
be seen: a connection that is not psycopg 3's, a statement whose
parameters or returned columns need a type's bind or result processor, an engine with ``echo`` or with
listeners for ``before_cursor_execute``, ``after_cursor_execute`` or
``handle_error`` other than the worker's own (SQL logging, tracing, error translation see every
statement, as they always did), a connection with a
``schema_translate_map``. A driver error is raised as SQLAlchemy
would raise it (:class:`sqlalchemy.exc.DBAPIError` with the driver's
error as ``orig``), and a disconnect invalidates the connection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.expression import Executable

# The worker's own ``handle_error`` (connections.discard_fatal) lives there; it
# changes only the errors of the worker's own engines. Named, not imported:
# this module stays a leaf of the imports.
_OWN_LISTENERS = "sa_jobqueue.connections"


class DirectStatement:
    """One statement of the library, executed directly where nothing would notice."""

    def __init__(self, statement: Executable, *, results: Sequence[Any] = ()) -> None:
        """``results``: the types of the columns it returns, so that one
        whose type converts values read from the driver (an ``Enum``, a
        ``TypeDecorator``) sends it through SQLAlchemy."""
        self.statement = statement
        self.results = list(results)
        # By dialect: its SQL and the values the statement binds itself (a
        # ``values(status='done')``), or None when it needs SQLAlchemy.
        self._sql: dict[Dialect, tuple[str, dict[str, Any]] | None] = {}

    def rows(self, connection: Connection, params: Mapping[str, Any]) -> Sequence[Any]:
        """Execute on ``connection`` (in its current transaction) and return all rows, as tuples."""
        dbapi_connection = connection.connection.dbapi_connection
        direct = self._direct_sql(connection) if isinstance(dbapi_connection, psycopg.Connection) else None
        if direct is None:
            return connection.execute(self.statement, params).all()
        assert isinstance(dbapi_connection, psycopg.Connection)
        sql, values = direct
        if values:
            params = {**values, **params}
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(sql, params)
            return cursor.fetchall()
        except psycopg.Error as exc:
            raise _wrapped(connection, sql, params, exc, cursor) from exc
        finally:
            cursor.close()

    def _direct_sql(self, connection: Connection) -> tuple[str, dict[str, Any]] | None:
        if connection.engine.echo or _observed(connection):
            return None
        if connection.get_execution_options().get("schema_translate_map"):
            return None  # the schema is chosen at execution
        dialect = connection.dialect
        try:
            return self._sql[dialect]
        except KeyError:
            converts = any(_reads(kind, dialect) for kind in self.results)
            sql = self._sql[dialect] = None if converts else _compile(self.statement, dialect)
            return sql


def _observed(connection: Connection) -> bool:
    """Whether listeners would see (or change) this connection's statements.
    The worker's own ``handle_error`` does not count: it changes only the
    errors of the worker's own engines."""
    dispatch: Any = connection.dispatch
    if dispatch.before_cursor_execute or dispatch.after_cursor_execute:
        return True
    handlers: Any = connection.dialect.dispatch.handle_error
    return any(getattr(handler, "__module__", None) != _OWN_LISTENERS for handler in handlers)


def _compile(statement: Executable, dialect: Dialect) -> tuple[str, dict[str, Any]] | None:
    """The SQL of ``statement`` for ``dialect`` and the values it binds itself;
    None when a parameter's type converts its value in Python (the driver
    would be sent the wrong value) or is rendered at execution (a list
    expanded into ``IN``)."""
    if dialect.paramstyle != "pyformat":
        return None
    compiled = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
    for bind in compiled.binds.values():
        if bind.expanding or bind.literal_execute:
            return None
        if bind.type.dialect_impl(dialect).bind_processor(dialect) is not None:
            return None
    required = {bind.key for bind in compiled.binds.values() if bind.required}  # the caller's parameters
    values = {name: value for name, value in compiled.params.items() if name not in required}
    return str(compiled.string), values


def _reads(kind: Any, dialect: Dialect) -> bool:
    """Whether SQLAlchemy converts values of the type ``kind`` as it reads them."""
    return kind.dialect_impl(dialect).result_processor(dialect, None) is not None


def _wrapped(connection: Connection, sql: str, params: Mapping[str, Any], exc: psycopg.Error,
             cursor: Any) -> BaseException:
    """``exc`` as SQLAlchemy raises a driver's error; a disconnect invalidates ``connection``."""
    dialect = connection.dialect
    disconnect = dialect.is_disconnect(exc, connection.connection.dbapi_connection, cursor)  # type: ignore[arg-type]
    wrapped = sa_exc.DBAPIError.instance(
        sql, dict(params), exc, psycopg.Error, hide_parameters=connection.engine.hide_parameters,
        connection_invalidated=disconnect, dialect=dialect,
    )
    if disconnect:
        connection.invalidate(exc)
    return wrapped
