"""Alembic environment of sa_jobqueue's own revisions (the table ``sa_jobqueue_jobs``).

From the shell, the database comes from ``DATABASE_URL``; a plain
``postgresql://`` URL is driven by psycopg 3::

    DATABASE_URL=postgresql://user@host/dbname alembic upgrade head
    DATABASE_URL=postgresql://user@host/dbname alembic check
    alembic upgrade head --sql          # offline: prints the DDL, no database needed

From Python (tests, a demo, an app's start-up script), hand over a
connection whose transaction has begun; the migrations then run in it and
commit or roll back with it (on a connection with no transaction begun,
``command.upgrade`` commits by itself; see docs/alembic.md)::

    cfg = alembic.config.Config("alembic.ini")
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        alembic.command.upgrade(cfg, "head")

The history is kept in ``sa_jobqueue_alembic_version`` rather than the usual
``alembic_version``, so these revisions can run against an application's
database that has an Alembic history of its own. Autogenerate (``alembic
check``, ``revision --autogenerate``) looks only at the tables of
``sa_jobqueue.default.Base.metadata``, ``sa_jobqueue.periodic.PeriodicBase.metadata`` and
``sa_jobqueue.control_tables.ControlBase.metadata``:
the application's other tables are neither reported as drift nor dropped.
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any, Literal

from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection

from alembic import context
from sa_jobqueue.control_tables import ControlBase
from sa_jobqueue.default import Base
from sa_jobqueue.migrations import CALLERS_TRANSACTION
from sa_jobqueue.periodic import PeriodicBase
from sa_jobqueue.urls import psycopg_url

VERSION_TABLE = "sa_jobqueue_alembic_version"

config = context.config
# The default job table, the periodic schedules' table (sa_jobqueue_periodic) and
# the operations tables (sa_jobqueue_workers, sa_jobqueue_paused_queues).
target_metadata = [Base.metadata, PeriodicBase.metadata, ControlBase.metadata]
OWN_TABLES = {name for metadata in target_metadata for name in metadata.tables}

# A caller that hands over its connection also owns its logging setup.
if config.config_file_name is not None and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _database_url() -> str | None:
    url = os.environ.get("DATABASE_URL", "").strip()
    return url or None


def _include_name(
    name: str | None,
    type_: Literal[
        "schema", "table", "column", "index", "unique_constraint", "foreign_key_constraint"
    ],
    parent_names: Any,
) -> bool:
    # This environment owns the tables of its metadata and nothing else in the
    # database; without the filter, autogenerate would propose dropping every
    # other table of the application.
    if type_ == "table":
        return name in OWN_TABLES
    return True


COMPARE_OPTIONS: dict[str, Any] = {
    "target_metadata": target_metadata,
    "version_table": VERSION_TABLE,
    "include_name": _include_name,
    "compare_type": True,
    # Alembic asks PostgreSQL itself whether two defaults are equal, so
    # '{}' vs '{}'::jsonb or 'pending' vs 'pending'::character varying match.
    "compare_server_default": True,
    # A revision with an autocommit block (0004 builds an index
    # CONCURRENTLY) commits what ran before it: one transaction per revision
    # keeps each revision whole and its version row with it.
    "transaction_per_migration": True,
}


def run_migrations_offline() -> None:
    """Render the migrations as SQL (``--sql``); no connection is made."""
    url = _database_url()
    if url is not None:
        context.configure(
            url=psycopg_url(url),
            literal_binds=True,
            dialect_opts={"paramstyle": "named"},
            **COMPARE_OPTIONS,
        )
    else:
        # Offline output needs only the dialect, not a server.
        context.configure(
            dialect_name="postgresql",
            literal_binds=True,
            dialect_opts={"paramstyle": "named"},
            **COMPARE_OPTIONS,
        )
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection: Connection, *, handed_over: bool = False) -> None:
    # A connection handed over with its transaction begun keeps every
    # revision in that transaction (docs/alembic.md): no autocommit blocks.
    callers = handed_over and connection.in_transaction()
    context.configure(connection=connection, **COMPARE_OPTIONS, **{CALLERS_TRANSACTION: callers})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run on ``config.attributes["connection"]`` if given, else on ``DATABASE_URL``."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection, handed_over=True)
        return
    url = _database_url()
    if url is None:
        raise SystemExit(
            "sa_jobqueue migrations: DATABASE_URL is not set. Set it to the database "
            "to migrate, e.g. DATABASE_URL=postgresql://user@localhost/dbname alembic "
            "upgrade head (or pass --sql to print the DDL without a database)."
        )
    engine = create_engine(psycopg_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            _run_on(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
