"""``COPY … FROM STDIN`` on a session's own connection, whichever of
SQLAlchemy's PostgreSQL drivers it runs on: psycopg 3, psycopg 3 async, or
asyncpg.

The async drivers are reached from sync code the way SQLAlchemy's own
asyncio support reaches them: the calling code runs in the greenlet of
:meth:`~sqlalchemy.ext.asyncio.AsyncSession.run_sync`, and each driver
coroutine is awaited there with SQLAlchemy's ``await_``. Nothing here imports
SQLAlchemy's asyncio extension or asyncpg unless a session runs on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Table
from sqlalchemy.orm import Session


def copy_connection(session: Session) -> Any | None:
    """The session's driver connection (opening its transaction) when COPY
    can run on it, else None: another driver, or a ``schema_translate_map``
    that the COPY's table name would ignore."""
    connection = session.connection()
    if connection.get_execution_options().get("schema_translate_map"):
        return None
    raw = connection.connection.driver_connection
    if isinstance(raw, (psycopg.Connection, psycopg.AsyncConnection)) or _is_asyncpg(raw):
        return raw
    return None


def copy_records(conn: Any, table: Table, columns: Sequence[str], records: Iterable[tuple[Any, ...]]) -> None:
    """Write ``records`` (one value per column of ``columns``, in order; a
    ``jsonb`` value as its JSON text) into ``table`` with one COPY, on
    ``conn``, a connection :func:`copy_connection` returned. ``records`` is
    iterated once, as the rows are sent."""
    if isinstance(conn, psycopg.Connection):
        with conn.cursor() as cursor, cursor.copy(_statement(table, columns)) as copy:
            for record in records:
                copy.write_row(record)
    elif isinstance(conn, psycopg.AsyncConnection):
        _await(_copy_psycopg_async(conn, _statement(table, columns), records))
    else:
        _await(conn.copy_records_to_table(table.name, records=records, columns=list(columns),
                                          schema_name=table.schema))


def _statement(table: Table, columns: Sequence[str]) -> sql.Composed:
    name = sql.Identifier(table.schema, table.name) if table.schema else sql.Identifier(table.name)
    return sql.SQL("COPY {} ({}) FROM STDIN").format(name, sql.SQL(", ").join(map(sql.Identifier, columns)))


async def _copy_psycopg_async(
    conn: psycopg.AsyncConnection[Any], statement: sql.Composed, records: Iterable[tuple[Any, ...]]
) -> None:
    async with conn.cursor() as cursor, cursor.copy(statement) as copy:
        for record in records:
            await copy.write_row(record)


def _is_asyncpg(raw: object) -> bool:
    # By module: asyncpg is imported only by applications that use it.
    return type(raw).__module__.split(".")[0] == "asyncpg"


def _await(awaitable: Any) -> Any:
    """Await a driver coroutine from the greenlet of ``AsyncSession.run_sync``."""
    from sqlalchemy import util

    wait = getattr(util, "await_", None) or util.await_only  # await_only: SQLAlchemy 2.0's name
    return wait(awaitable)


__all__ = ["copy_connection", "copy_records"]
