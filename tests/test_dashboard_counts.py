"""The dashboard's counts on a big table (sa_jobqueue.dashboard.counts, docs/dashboard.md "Counts on a big
table"): counted up to a limit and shown as ``10,000+`` past it, through the indexes, with the plans checked."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from jobapp import ReportJob, reports
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from sa_jobqueue.dashboard.counts import COUNT_LIMIT, QueueCounts, count_matching, queue_counts, shown
from sa_jobqueue.dashboard.filters import JobFilter
from sa_jobqueue.dashboard.render import environment
from sa_jobqueue.dashboard.views import Views

TABLE = ReportJob.__tablename__


@pytest.fixture(scope="module")
def big(module_database: tuple[URL, Engine]) -> Iterator[Engine]:
    """report_jobs (it keeps finished jobs) with 10,003 done jobs in queue ``bulk`` (finished now), two dead
    ones finished two minutes ago, and in queue ``mixed`` pending jobs over three priorities (the oldest
    runnable one 10 minutes late, a future one older than it at a higher priority) and a running one."""
    _, engine = module_database
    with engine.begin() as conn:
        conn.execute(text(
            f"INSERT INTO {TABLE} (queue, task, status, attempts, finished_at) "
            "SELECT 'bulk', 'monthly', 'done', 1, now() FROM generate_series(1, :n)"), {"n": COUNT_LIMIT + 3})
        conn.execute(text(
            f"INSERT INTO {TABLE} (queue, task, status, attempts, finished_at) "
            "SELECT 'bulk', 'monthly', 'dead', 1, now() - interval '2 minutes' FROM generate_series(1, 2)"))
        conn.execute(text(
            f"INSERT INTO {TABLE} (queue, task, status, priority, run_at) VALUES "
            "('mixed', 'weekly', 'pending', -5, now() + interval '1 hour'), "
            "('mixed', 'weekly', 'pending', 0, now() - interval '10 minutes'), "
            "('mixed', 'weekly', 'pending', 0, now() - interval '1 minute'), "
            "('mixed', 'weekly', 'pending', 7, now() - interval '3 minutes')"))
        conn.execute(text(
            f"INSERT INTO {TABLE} (queue, task, status, attempts, locked_at, lease_expires_at) "
            "VALUES ('mixed', 'weekly', 'running', 1, now(), now() + interval '1 minute')"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {TABLE}"))
    yield engine
    with engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {TABLE}"))


def test_counts_stop_at_the_limit_and_show_it_as_a_plus(big: Engine) -> None:
    with Session(big) as session:
        bulk, mixed = queue_counts(session, reports)
    assert bulk.queue == "bulk" and bulk.counts["done"] == COUNT_LIMIT + 1 and bulk.counts["dead"] == 2
    assert bulk.shown("done") == "10,000+" and bulk.shown("dead") == "2" and bulk.shown("pending") == "0"
    assert bulk.oldest_runnable_age is None
    assert mixed.counts == {"pending": 4, "running": 1, "done": 0, "dead": 0, "cancelled": 0}
    # The oldest runnable job of the queue, whatever its priority; the future one does not count.
    assert mixed.oldest_runnable_age is not None
    assert timedelta(minutes=10) <= mixed.oldest_runnable_age < timedelta(minutes=11)
    assert shown(COUNT_LIMIT, COUNT_LIMIT) == "10,000" and shown(1234, 10) == "10+"


def test_counts_below_the_limit_are_exact(big: Engine) -> None:
    with Session(big) as session:
        bulk = queue_counts(session, reports, limit=COUNT_LIMIT + 10)[0]
    assert bulk.counts["done"] == COUNT_LIMIT + 3 and bulk.shown("done") == "10,003"


def test_the_overview_page_shows_a_capped_count_as_10000_plus(big: Engine) -> None:
    rendered = Views(big, [reports]).overview()
    html = environment().get_template(rendered.template).render({**rendered.context, "base": ""})
    assert 'data-status="done"><a href="/jobs?table=report_jobs&amp;queue=bulk&amp;status=done">10,000+</a>' in html
    # The chart is what the workers counted (sa_jobqueue.throughput), not the table's rows: none here.
    assert "0 done, 0 failed in the last hour" in html
    assert isinstance(rendered.context["tables"][0].queues[0], QueueCounts)


def test_the_confirmation_counts_up_to_the_limit(big: Engine) -> None:
    with Session(big) as session:
        assert count_matching(session, reports, JobFilter(status="done"), COUNT_LIMIT) == COUNT_LIMIT + 1
        assert count_matching(session, reports, JobFilter(status="dead", queue="bulk"), COUNT_LIMIT) == 2
        assert count_matching(session, reports, JobFilter(queue="mixed"), 3) == 4
    rendered = Views(big, [reports]).confirm({"table": TABLE, "action": "delete", "status": "done"}, "token")
    assert rendered.context["count"] == "10,000+"


def _plan(engine: Engine, sql: str) -> str:
    with engine.connect() as conn:
        return "\n".join(conn.execute(text(f"EXPLAIN {sql}")).scalars())


@pytest.mark.parametrize(("sql", "indexes"), [
    # A filter that matches nothing no longer walks the primary key through every row.
    (f"SELECT id FROM {TABLE} WHERE status = 'pending' AND queue = 'bulk' ORDER BY id DESC LIMIT 51", "status"),
    (f"SELECT count(*) FROM (SELECT 1 FROM {TABLE} WHERE status = 'dead' LIMIT 10001) c", "status"),
])
def test_the_pages_queries_read_the_dashboards_indexes(big: Engine, sql: str, indexes: str) -> None:
    plan = _plan(big, sql)
    assert any(f"ix_{TABLE}_{index}_v1" in plan for index in indexes.split()), plan
