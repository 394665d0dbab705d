"""The PostgreSQL health of a job table, as the dashboard's overview shows it.

:func:`table_health` reads the statistics views (``pg_stat_user_tables``,
the relation sizes, ``pg_stat_activity``) for one table: dead tuples, the last
autovacuum, table and index size, and the oldest transaction that holds back
vacuum anywhere on the server. Each figure comes with the threshold of
docs/operations.md ("What to watch"), and :attr:`TableHealth.warnings` says
which are past theirs. Reads only; the views take no lock a worker waits on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Table, text
from sqlalchemy.orm import Session

# The thresholds of docs/operations.md, "What to watch".
OLDEST_TRANSACTION_LIMIT = timedelta(minutes=5)
"""A transaction older than this holds back vacuum long enough to matter ("a few minutes")."""
DEAD_TUPLES_RATIO = 10
"""Dead tuples this many times the live ones (and over :data:`DEAD_TUPLES_FLOOR`): vacuum is not keeping up."""
DEAD_TUPLES_FLOOR = 10_000
OLDEST_RUNNABLE_LIMIT = timedelta(minutes=5)
"""The oldest runnable job waiting longer than this: workers are behind or down (``sa-jobqueue health``'s default)."""

_TABLE_STATS = text(
    "SELECT n_live_tup, n_dead_tup, last_autovacuum, last_vacuum, "
    "pg_table_size(relid) AS table_bytes, pg_indexes_size(relid) AS index_bytes "
    "FROM pg_stat_user_tables WHERE relid = CAST(:table AS regclass)"
)
# Server-wide: a transaction that has written (backend_xid) holds back vacuum in every database.
_OLDEST_TRANSACTION = text(
    "SELECT pid, datname, state, xact_start, query_start, now() - xact_start AS age, left(query, 200) AS query "
    "FROM pg_stat_activity "
    "WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) AND pid <> pg_backend_pid() "
    "ORDER BY greatest(age(backend_xmin), age(backend_xid)) DESC NULLS LAST LIMIT 1"
)


@dataclass(frozen=True)
class OldestTransaction:
    """The transaction holding back vacuum the longest: its backend, since when, and what it runs."""

    pid: int
    database: str | None
    state: str | None
    started: datetime | None
    query_start: datetime | None
    age: timedelta | None
    query: str | None


@dataclass(frozen=True)
class TableHealth:
    """One job table's health; ``warnings`` lists, in words, each figure past its threshold."""

    live_tuples: int
    dead_tuples: int
    last_autovacuum: datetime | None
    table_bytes: int
    index_bytes: int
    oldest_transaction: OldestTransaction | None
    warnings: list[str] = field(default_factory=list)


def table_health(session: Session, table: Table) -> TableHealth:
    """``table``'s health now (zeros for a table the statistics collector has not seen yet)."""
    name = session.connection().dialect.identifier_preparer.format_table(table)
    stats = session.execute(_TABLE_STATS, {"table": name}).first()
    row = session.execute(_OLDEST_TRANSACTION).first()
    oldest = None if row is None else OldestTransaction(
        row.pid, row.datname, row.state, row.xact_start, row.query_start, row.age, row.query)
    live = int(stats.n_live_tup) if stats is not None else 0
    dead = int(stats.n_dead_tup) if stats is not None else 0
    health = TableHealth(
        live_tuples=live, dead_tuples=dead,
        last_autovacuum=None if stats is None else stats.last_autovacuum,
        table_bytes=0 if stats is None else int(stats.table_bytes),
        index_bytes=0 if stats is None else int(stats.index_bytes),
        oldest_transaction=oldest,
    )
    if dead > DEAD_TUPLES_FLOOR and dead > DEAD_TUPLES_RATIO * max(live, 1):
        health.warnings.append(f"{dead:,} dead tuples, over {DEAD_TUPLES_RATIO}x the {live:,} live ones: "
                               "vacuum is not keeping up, or a transaction holds it back")
    if oldest is not None and oldest.age is not None and oldest.age > OLDEST_TRANSACTION_LIMIT:
        health.warnings.append(f"transaction of pid {oldest.pid} open for {oldest.age}: it holds back vacuum "
                               f"(over {OLDEST_TRANSACTION_LIMIT})")
    return health


__all__ = [
    "DEAD_TUPLES_FLOOR", "DEAD_TUPLES_RATIO", "OLDEST_RUNNABLE_LIMIT", "OLDEST_TRANSACTION_LIMIT",
    "OldestTransaction", "TableHealth", "table_health",
]
