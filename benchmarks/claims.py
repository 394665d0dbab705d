"""Claims at scale: a claim from a small queue beside big backlogs, timed and explained.

Each scenario is a fresh table: 1,000 runnable jobs in queue "urgent", and
for the big ones ``backlog`` more jobs that the claim must not read (older
pending jobs of another queue, or jobs of the same queue due in an hour,
half of them at a priority that sorts ahead of the runnable ones). The
figure is the median time of ``JobRepository.claim(limit=10)`` from
"urgent" and its commit, as the worker claims, under PostgreSQL's usual plan
choice (psycopg prepares the claim at its fifth run; PostgreSQL then keeps
its generic plan, ``tests/test_claim_scale.py`` checks) and under
``plan_cache_mode = force_generic_plan`` (what a pooler that prepares
statements gets). After each claim, untimed, the claimed jobs are put back
as they were, so that the table stays as loaded (a rollback would do that
too, but psycopg forgets what it prepared in a transaction that rolls back). The
plans come from ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim prepared as the
library sends it. ``tests/test_claim_scale.py`` uses :func:`explain_claim`
too, to count the buffers a claim reads.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import psycopg
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.types import NullType

SMALL_QUEUE = "urgent"
READY = 1_000
LIMIT = 10
SCENARIOS = {
    "small": f"{READY:,} runnable jobs in queue {SMALL_QUEUE!r}, nothing else",
    "other-queue": "the same, and the backlog pending in queue 'bulk', all older",
    "scheduled": f"the same, and the backlog in {SMALL_QUEUE!r} due in an hour, half at priority -1",
}
MODES = ("auto", "force_generic_plan")


def load(dsn: str, table: str, scenario: str, backlog: int) -> None:
    """Fill ``table`` for ``scenario``, then VACUUM ANALYZE it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        insert = f"INSERT INTO {table} (queue, task, priority, run_at) "
        conn.execute(
            insert + "SELECT %s, 'bench', 0, now() - interval '1 minute' + g * interval '1 ms' "
            "FROM generate_series(1, %s) g",
            (SMALL_QUEUE, READY),
        )
        if scenario == "other-queue":
            conn.execute(insert + "SELECT 'bulk', 'bench', 0, now() - interval '1 hour' FROM generate_series(1, %s)",
                         (backlog,))
        elif scenario == "scheduled":
            conn.execute(
                insert + "SELECT %s, 'bench', -(g %% 2), now() + interval '1 hour' FROM generate_series(1, %s) g",
                (SMALL_QUEUE, backlog),
            )
        conn.execute(f"VACUUM ANALYZE {table}")


def time_claims(url: Any, samples: int) -> dict[str, float]:
    """Median milliseconds of one claim of ``LIMIT`` jobs and its commit, per plan mode."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    from sa_jobqueue import JobRepository
    from sa_jobqueue.default import Job

    repo = JobRepository(Job)
    engine = create_engine(url, pool_size=1)
    medians = {}
    try:
        for mode in MODES:
            with engine.connect() as conn:
                conn.exec_driver_sql(f"SET plan_cache_mode = {mode}")
                conn.commit()
                times = []
                for n in range(samples + 10):  # the first ten warm up and get the statement prepared
                    with Session(bind=conn) as session:
                        started = time.perf_counter()
                        claimed = repo.claim(session, queues=[SMALL_QUEUE], limit=LIMIT)
                        session.commit()
                        elapsed = time.perf_counter() - started
                        session.execute(text(
                            f"UPDATE {Job.__tablename__} SET status = 'pending', attempts = 0, locked_at = NULL, "
                            "locked_by = NULL, lease_expires_at = NULL, lock_token = NULL WHERE id = ANY(:ids)"
                        ), {"ids": [job.id for job in claimed]})
                        session.commit()
                    if len(claimed) != LIMIT:
                        raise RuntimeError(f"claim took {len(claimed)} jobs, expected {LIMIT}")
                    if n >= 10:
                        times.append(elapsed * 1000)
                medians[mode] = statistics.median(times)
    finally:
        engine.dispose()
    return medians


def prepared_claim(
    model: Any, queues: list[str], limit: int, name: str = "sajq_claim"
) -> tuple[str, str, dict[str, Any]]:
    """The library's claim statement on ``model`` as SQL: ``(PREPARE name(…) AS …,
    EXECUTE name(…) with placeholders, the values)``. The EXECUTE takes its
    arguments as literals: run it on a ``psycopg.ClientCursor``."""
    from sa_jobqueue import statements
    from sa_jobqueue.claim import DEFAULT_LEASE

    dialect = PGDialect_psycopg(paramstyle="numeric_dollar")
    if hasattr(statements, "limit_bound"):  # a parameter per queue, scans bounded in the statement
        statement = statements.claim(model, len(queues), statements.limit_bound(limit))
        named: dict[str, Any] = dict(zip(statements.queue_keys(len(queues)), queues, strict=True))
    else:  # cores whose claim takes the queues as one array (and maybe the limit as a literal)
        statement, named = statements.claim(model), {"queues": queues}
    compiled = statement.returning(model.__table__.c.id).compile(dialect=dialect)
    # A limit rendered as a literal at execution shows as a placeholder here.
    sql = str(compiled).replace("__[POSTCOMPILE_limit]", str(limit))
    values = compiled.params | named | {"worker": "bench", "lease": DEFAULT_LEASE, "limit": limit}
    order = [key for key in compiled.positiontup or [] if f"__[POSTCOMPILE_{key}]" not in str(compiled)]
    types = ", ".join(_sql_type(dialect, compiled.binds[key].type) for key in order)
    placeholders = ", ".join(f"%({key})s" for key in order)
    return f"PREPARE {name}({types}) AS {sql}", f"EXECUTE {name}({placeholders})", values


def explain_claim(dsn: str, model: Any, queues: list[str], limit: int, plan_cache_mode: str,
                  fmt: str = "JSON") -> tuple[Any, list[int]]:
    """EXPLAIN (ANALYZE, BUFFERS) of the library's claim statement on ``model``,
    prepared as the driver would prepare it, then the claim itself; both
    rolled back. Returns (the plan, JSON-decoded or as text lines, and the
    claimed ids)."""
    prepare, execute, values = prepared_claim(model, queues, limit)
    with psycopg.connect(dsn) as conn:
        cur = psycopg.ClientCursor(conn)  # EXECUTE takes its arguments as literals
        cur.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        cur.execute(prepare)
        cur.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT {fmt}) {execute}", values)
        rows = cur.fetchall()
        conn.rollback()
        cur.execute(execute, values)
        claimed = [row[0] for row in cur.fetchall()]
        conn.rollback()
    if fmt == "JSON":
        plan = rows[0][0]
        return (plan if isinstance(plan, list) else json.loads(plan)), claimed
    return [row[0] for row in rows], claimed


def _sql_type(dialect: PGDialect_psycopg, type_: Any) -> str:
    # An untyped parameter is the LIMIT of a claim that binds it.
    return "integer" if isinstance(type_, NullType) else str(dialect.type_compiler_instance.process(type_))
