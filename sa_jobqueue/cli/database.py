"""The commands' database: an engine from the URL given, and database errors as one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError

from ..errors import JobQueueError
from ..urls import psycopg_url
from .errors import CliError, CliUsageError, first_line

__all__ = ["CONNECT_TIMEOUT", "database_errors", "make_engine", "show_url"]

CONNECT_TIMEOUT = 5  # seconds: an unreachable server fails fast


def show_url(url: URL) -> str:
    """The URL with its password as ``***``."""
    return url.render_as_string(hide_password=True)


def make_engine(raw_url: str | None, **kwargs: Any) -> Engine:
    """An engine for the URL given or from DATABASE_URL; errors never show the password."""
    if not raw_url:
        raise CliUsageError("no database URL: pass --database-url or set DATABASE_URL")
    try:
        url = psycopg_url(raw_url)
    except ArgumentError:
        # SQLAlchemy's message quotes the whole string, password included.
        raise CliUsageError("the database URL cannot be parsed; expected postgresql://user@host:port/db") from None
    if not url.drivername.startswith("postgresql"):
        raise CliUsageError(f"the database URL must be a PostgreSQL one, got {show_url(url)}")
    try:
        return create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT}, **kwargs)
    except (ArgumentError, NoSuchModuleError, ImportError) as exc:
        raise CliUsageError(f"cannot use the database URL {show_url(url)}: {first_line(exc)}") from None


@contextmanager
def database_errors(engine: Engine, table: str | None = None) -> Iterator[None]:
    """Turn database and library errors into one-line :class:`CliError`\\ s."""
    where = show_url(engine.url)
    try:
        yield
    except JobQueueError as exc:  # InvalidArgumentError and kin: the library's message
        raise CliError(str(exc)) from None
    except DBAPIError as exc:
        sqlstate = getattr(exc.orig, "sqlstate", None)
        message = first_line(exc.orig) if exc.orig is not None else first_line(exc)
        if sqlstate == "42P01" and table is not None:
            raise CliError(
                f"table {table!r} does not exist in {where}; create it (alembic upgrade head, "
                "or metadata.create_all) or pick the model with --model"
            ) from None
        if exc.connection_invalidated or sqlstate is None or sqlstate.startswith("08"):
            raise CliError(f"cannot connect to {where}: {message}") from None
        raise CliError(f"database error on {where}: {message}") from None
    except SQLAlchemyError as exc:
        raise CliError(f"database error on {where}: {first_line(exc)}") from None
