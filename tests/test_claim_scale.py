"""The claim reads what it locks, whatever else the table holds.

A claim from a small queue must not walk another queue's backlog, nor the
jobs scheduled for later, nor change shape under a generic plan (a pooler
that prepares statements). These tests load a table with such backlogs and
count the buffers the claim touches (EXPLAIN ANALYZE, BUFFERS): a count, not
a timing, so it holds on a busy machine. A claim that walked either backlog
would touch thousands of buffers; one that reads its own range touches tens.
The EXPLAIN is benchmarks/claims.py's, which shows the same plans at
1,000,000 rows.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jobapp import TaskJob, jobs
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

_spec = importlib.util.spec_from_file_location(
    "sajq_benchmarks_claims", Path(__file__).resolve().parent.parent / "benchmarks" / "claims.py"
)
assert _spec is not None and _spec.loader is not None
claims = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(claims)

BACKLOG = 30_000
# Buffers the picking (CTE ``picked``) may touch: it reads three priorities
# and locks ten rows. Walking either backlog would visit a heap page per entry:
# tens of thousands of buffers.
MOST_BUFFERS = 150


@pytest.fixture
def backlogs(engine: Engine) -> Iterator[list[int]]:
    """30,000 older jobs of priority 1 in queue "bulk", 30,000 future jobs in "urgent"
    (ahead of and level with the runnable ones in priority), and three
    runnable "urgent" jobs at priorities 0, 1 and 5; yields their ids in claim order."""
    with engine.begin() as conn:
        for queue, priority, run_at in (
            ("bulk", 1, "now() - interval '1 hour'"),
            ("urgent", -1, "now() + interval '1 hour'"),
            ("urgent", 0, "now() + interval '1 hour'"),
        ):
            conn.execute(text(
                "INSERT INTO task_jobs (queue, task, priority, run_at) "
                f"SELECT :queue, 'noop', :priority, {run_at} FROM generate_series(1, :n)"
            ), {"queue": queue, "priority": priority, "n": BACKLOG // 2 if queue == "urgent" else BACKLOG})
        ready = [
            conn.execute(text(
                "INSERT INTO task_jobs (queue, task, priority, run_at) "
                "VALUES ('urgent', 'noop', :priority, now() - interval '1 minute') RETURNING id"
            ), {"priority": priority}).scalar_one()
            for priority in (5, 1, 0)
        ]
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE task_jobs"))
    yield ready[::-1]


def _explain_claim(libpq_url: str, plan_cache_mode: str, queues: list[str]) -> tuple[dict[str, Any], list[int]]:
    plan, claimed = claims.explain_claim(libpq_url, TaskJob, queues, 10, plan_cache_mode)
    return plan[0]["Plan"], claimed


def _buffers(node: dict[str, Any]) -> int:
    return int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])


def _picking(root: dict[str, Any]) -> dict[str, Any]:
    [picked] = [node for node in _nodes(root) if node.get("Subplan Name") == "CTE picked"]
    return picked


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_a_small_queue_is_claimed_past_other_backlogs(
    libpq_url: str, backlogs: list[int], plan_cache_mode: str
) -> None:
    root, claimed = _explain_claim(libpq_url, plan_cache_mode, ["urgent"])
    assert sorted(claimed) == sorted(backlogs)
    assert _buffers(_picking(root)) <= MOST_BUFFERS, json.dumps(root, indent=1)
    scans = {node["Node Type"] for node in _nodes(root) if "Relation Name" in node}
    assert "Seq Scan" not in scans


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_a_claim_over_two_queues_keeps_priority_order(
    libpq_url: str, backlogs: list[int], plan_cache_mode: str
) -> None:
    root, claimed = _explain_claim(libpq_url, plan_cache_mode, ["urgent", "bulk"])
    # urgent's priority 0 first; then priority 1 of both queues, the older
    # bulk jobs before urgent's.
    assert len(claimed) == 10 and backlogs[0] in claimed
    assert backlogs[1] not in claimed and backlogs[2] not in claimed
    assert _buffers(_picking(root)) <= MOST_BUFFERS, json.dumps(root, indent=1)


@pytest.mark.parametrize("queues", [["urgent"], ["urgent", "bulk"]])
def test_postgres_settles_on_the_generic_plan_of_a_claim(engine: Engine, queues: list[str]) -> None:
    """psycopg prepares a statement at its fifth execution; PostgreSQL plans
    it with its values five more times, then keeps the generic plan if that
    costs no more. A claim whose generic plan looked costlier (``unnest`` of
    the queues, a ``LIMIT $n``) was planned anew at every execution."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO task_jobs (queue, task) "
            "SELECT q, 'noop' FROM unnest(ARRAY['urgent', 'bulk']) q, generate_series(1, 100)"
        ))
    with engine.connect() as conn:
        for _ in range(20):
            # Committed, as the worker's claims are: psycopg forgets what it
            # prepared in a transaction that rolls back.
            with Session(bind=conn) as session:
                assert len(jobs.claim(session, queues=queues, limit=5)) == 5
                session.commit()
        generic, custom = conn.execute(text(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE 'WITH picked AS%'"
        )).one()
        conn.rollback()
    assert custom <= 5 and generic >= 10, (generic, custom)


@pytest.mark.parametrize("limit", [1, 3, 5])
def test_a_claim_from_one_queue_locks_only_the_jobs_it_takes(engine: Engine, limit: int) -> None:
    """Its statement is built for a power of two at or above ``limit``
    (statements.limit_bound); the rows past ``limit`` are never locked, so
    other workers claim them meanwhile."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO task_jobs (queue, task) SELECT 'urgent', 'noop' FROM generate_series(1, 20)"))
    with Session(engine) as holder, engine.connect() as other:
        held = jobs.claim(holder, queues="urgent", limit=limit)  # not committed: its locks stay
        free = other.execute(text(
            "SELECT count(*) FROM (SELECT id FROM task_jobs WHERE status = 'pending' FOR UPDATE SKIP LOCKED) s"
        )).scalar_one()
        other.rollback()
        holder.rollback()
    assert len(held) == limit and free == 20 - limit


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_a_claim_of_a_hundred_jobs_updates_them_by_the_primary_key(
    engine: Engine, libpq_url: str, plan_cache_mode: str
) -> None:
    """A join of the claimed ids to the table turned into a hash join over a
    sequential scan of the whole table once the planner expected a hundred
    rows out of a few thousand."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO task_jobs (queue, task) SELECT 'bulk', 'noop' FROM generate_series(1, 5000)"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE task_jobs"))
    plan, claimed = claims.explain_claim(libpq_url, TaskJob, ["bulk"], 100, plan_cache_mode)
    root = plan[0]["Plan"]
    assert len(claimed) == 100
    assert not [node for node in _nodes(root) if node["Node Type"] == "Seq Scan"], json.dumps(root, indent=1)
