"""The dashboard's pages over HTTP (docs/dashboard.md): ``sa-jobqueue dashboard`` serving
tests/jobapp.py's tables from a database of this module's, a real PostgreSQL behind it."""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from dashboard_server import get, serving
from jobapp import TaskJob, emails, jobs, reports
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session
from test_docs import DOCS, python_blocks, section

from sa_jobqueue import JobSpec, Periodic, PeriodicScheduler, create_periodic_table
from sa_jobqueue.dashboard.filters import FilterError, JobFilter, parse_filter
from sa_jobqueue.dashboard.render import age, size
from sa_jobqueue.throughput import add_finished

LEASE = timedelta(seconds=60)


@pytest.fixture(scope="module")
def dashboard_db(module_database: tuple[URL, Engine]) -> tuple[URL, Engine]:
    return module_database


@pytest.fixture(scope="module")
def filled(dashboard_db: tuple[URL, Engine]) -> dict[str, int]:
    """Jobs of every kind: 120 pending in task_jobs (newest has user_id 119), one dead, one
    scheduled, an email job with a tenant, and report jobs finished done (with a result) and dead."""
    _, engine = dashboard_db
    with Session(engine) as session, session.begin():
        jobs.enqueue_many(session, [JobSpec("count", {"user_id": n}, queue="bulk") for n in range(120)])
        scheduled = jobs.enqueue(session, "later", {"when": "soon"}, queue="mail", delay=timedelta(hours=1))
        emails.enqueue(session, "send", {"to": "ada"}, extra={"tenant_id": 7})
        emails.enqueue(session, "send", {"to": "bob"}, extra={"tenant_id": 8})
        reports.enqueue_many(session, [JobSpec("monthly", {"n": n}) for n in range(3)])
    with Session(engine) as session, session.begin():
        done, failing, other = reports.claim(session, limit=3, lease=LEASE)
        reports.complete(session, done)
        session.execute(text("UPDATE report_jobs SET result = '{\"rows\": 12}' WHERE id = :id"), {"id": done.id})
        reports.fail(session, failing, "Traceback (most recent call last):\n  boom\nValueError: bad month",
                     discard=True)
        reports.complete(session, other)
        # What the workers' presence beats would have added for those (sa_jobqueue.throughput).
        add_finished(session, {("report_jobs", "default"): [2, 1]})
    with Session(engine) as session:
        newest = session.scalar(select(func.max(TaskJob.id)).where(TaskJob.queue == "bulk"))
        assert newest is not None
    return {"scheduled": scheduled.id, "done": done.id, "dead": failing.id, "newest": newest}


@pytest.fixture(scope="module")
def dashboard(dashboard_db: tuple[URL, Engine], filled: dict[str, int]) -> Iterator[str]:
    with serving(dashboard_db[0]) as address:
        yield address


def _ids(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr data-job="(\d+)"', html)]


def _query(**params: str) -> str:
    return "/jobs?" + urllib.parse.urlencode(params)


def test_the_overview_shows_counts_throughput_and_health(dashboard: str) -> None:
    status, html = get(dashboard, "/")
    assert status == 200
    for table in ("task_jobs", "email_jobs", "report_jobs"):
        assert f'data-table="{table}"' in html
    bulk = re.search(r'<tr data-queue="bulk">.*?</tr>', html, re.S)
    assert bulk is not None and re.search(r'data-status="pending"><a [^>]*>120<', bulk.group(0))
    assert "2 done, 1 failed in the last hour" in html  # as the workers counted them
    assert "0 done, 0 failed in the last hour" in html  # task_jobs: none counted, deleted or not
    assert "dead tuples" in html and "oldest transaction holding back vacuum" in html


def test_the_jobs_list_pages_by_keyset_newest_first(dashboard: str, filled: dict[str, int]) -> None:
    status, first = get(dashboard, _query(queue="bulk"))
    assert status == 200
    page = _ids(first)
    assert len(page) == 50 and page == sorted(page, reverse=True) and page[0] == filled["newest"]
    link = re.search(r'id="next-page" href="([^"]+)"', first)
    assert link is not None and "before=" in link.group(1) and "OFFSET" not in link.group(1)
    seen = list(page)
    while link is not None:
        status, html = get(dashboard, link.group(1).replace("&amp;", "&"))
        assert status == 200
        seen += _ids(html)
        link = re.search(r'id="next-page" href="([^"]+)"', html)
    assert len(seen) == len(set(seen)) == 120


@pytest.mark.parametrize(("params", "expected"), [
    ({"status": "scheduled"}, ["scheduled"]),
    ({"table": "report_jobs", "status": "dead"}, ["dead"]),
    ({"table": "report_jobs", "status": "done"}, ["done", "other"]),
    ({"queue": "bulk", "payload": "$.user_id == 119"}, ["newest"]),
])
def test_filters_narrow_the_list(dashboard: str, filled: dict[str, int], params: dict[str, str],
                                 expected: list[str]) -> None:
    status, html = get(dashboard, _query(**params))
    assert status == 200
    ids = _ids(html)
    assert filled[expected[0]] in ids
    assert len(ids) == len(expected)


def test_the_tables_own_columns_are_shown_and_filter(dashboard: str) -> None:
    status, html = get(dashboard, _query(table="email_jobs", **{"col.tenant_id": "7"}))
    assert status == 200 and len(_ids(html)) == 1
    assert "<th>tenant_id</th>" in html and "ada" not in html  # the list shows columns, not payloads
    status, html = get(dashboard, _query(table="email_jobs"))
    assert len(_ids(html)) == 2


@pytest.mark.parametrize(("params", "parameter"), [
    ({"status": "bogus"}, "status"),
    ({"id": "abc"}, "id"),
    ({"id": "-1"}, "id"),
    ({"before": "1e9"}, "before"),
    ({"payload": "$.user_id =="}, "payload"),
    ({"queue": "x" * 200}, "queue"),
    ({"queue": "a\x00b"}, "queue"),
    ({"col.nope": "1"}, "col.nope"),
    ({"sort": "id"}, "sort"),
])
def test_a_bad_filter_is_a_400_with_its_message(dashboard: str, dashboard_db: tuple[URL, Engine],
                                                params: dict[str, str], parameter: str) -> None:
    status, html = get(dashboard, _query(**params))
    assert status == 400
    assert re.search(rf'role="alert">{re.escape(parameter)}: ', html), html
    assert "Traceback" not in html


@pytest.mark.parametrize("path", [
    "/jobs?table=no_such_table", "/jobs/no_such_table/1", "/jobs/task_jobs/0", "/jobs/task_jobs/abc",
    "/jobs/task_jobs/99999999999999999999", "/jobs/task_jobs/" + "9" * 5000,
])
def test_an_unknown_table_or_job_is_a_404(dashboard: str, path: str) -> None:
    status, html = get(dashboard, path)
    assert status == 404 and 'role="alert"' in html and "Traceback" not in html


def test_a_job_shows_payload_result_error_and_timestamps(dashboard: str, filled: dict[str, int]) -> None:
    status, html = get(dashboard, f"/jobs/report_jobs/{filled['done']}")
    assert status == 200
    assert re.search(r'id="result">\{\s*&#34;rows&#34;: 12\s*\}', html), html
    assert "finished</dt><dd>20" in html and "enqueued</dt><dd>20" in html
    status, html = get(dashboard, f"/jobs/report_jobs/{filled['dead']}")
    assert 'id="last-error">Traceback (most recent call last):\n  boom\nValueError: bad month' in html


def test_markup_in_a_job_is_shown_as_text(dashboard_db: tuple[URL, Engine], dashboard: str) -> None:
    _, engine = dashboard_db
    with Session(engine) as session, session.begin():
        job = jobs.enqueue(session, "<script>alert(1)</script>", {"html": "<b>bold</b>"}, queue="xss")
    status, html = get(dashboard, f"/jobs/task_jobs/{job.id}")
    assert status == 200 and "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)" in html


def test_pages_write_nothing(dashboard_db: tuple[URL, Engine], dashboard: str) -> None:
    _, engine = dashboard_db

    def snapshot() -> list[tuple[object, ...]]:
        with Session(engine) as session:
            return [tuple(r) for r in session.execute(  # type: ignore[misc]
                text("SELECT id, status, run_at, attempts, lock_token FROM task_jobs UNION ALL "
                     "SELECT id, status, run_at, attempts, lock_token FROM report_jobs ORDER BY 1"))]

    before = snapshot()
    for path in ("/", "/jobs", _query(status="dead", table="report_jobs"), _query(payload="$.x ==")):
        get(dashboard, path)
    assert snapshot() == before


def test_a_page_runs_read_only(dashboard_db: tuple[URL, Engine]) -> None:
    """The views' transaction refuses a write: were a query to try, PostgreSQL would stop it."""
    from sa_jobqueue.dashboard.views import Views

    _, engine = dashboard_db
    views = Views(engine, [jobs])
    with pytest.raises(Exception, match="read-only transaction"):
        with views._reading() as session:  # noqa: SLF001 - the transaction every page runs in
            session.execute(text("UPDATE task_jobs SET priority = 1"))
    assert views.jobs({"status": "pending"}).status == 200


def test_no_page_takes_a_lock_a_worker_waits_on(dashboard_db: tuple[URL, Engine], filled: dict[str, int]) -> None:
    """After every statement of every page, the page's backend holds only ACCESS SHARE locks on
    relations (which no worker's INSERT, UPDATE or DELETE waits for) and no transaction id (a row lock
    or a write would have assigned one)."""
    from sqlalchemy import event

    from sa_jobqueue.dashboard.views import Views

    url, _ = dashboard_db
    engine = create_engine(url)
    held: list[tuple[str, str, str]] = []
    statements: list[str] = []

    @event.listens_for(engine, "after_cursor_execute")
    def look(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)
        with conn.connection.dbapi_connection.cursor() as own:  # a cursor of its own: no event, same backend
            own.execute("SELECT locktype, mode, coalesce(relation::regclass::text, '') FROM pg_locks "
                        "WHERE pid = pg_backend_pid() AND (locktype = 'transactionid' "
                        "OR (locktype = 'relation' AND mode <> 'AccessShareLock'))")
            held.extend(own.fetchall())

    views = Views(engine, [jobs, emails, reports])
    try:
        pages = [
            views.overview(), views.workers(), views.periodic(),
            views.jobs({"table": "task_jobs", "queue": "bulk", "payload": "$.user_id == 119"}),
            views.jobs({"table": "report_jobs", "status": "dead"}), views.jobs({"status": "scheduled"}),
            views.jobs({"table": "email_jobs", "col.tenant_id": "7"}),
            views.job("report_jobs", str(filled["done"])),
            views.confirm({"table": "task_jobs", "action": "retry", "status": "dead"}, "token"),
        ]
        assert [page.status for page in pages] == [200] * len(pages)
        assert len(statements) > 3 * len(pages) and held == []
    finally:
        engine.dispose()


# -- plain values: the filter and the page's words, no database


def test_parse_filter_takes_the_documented_parameters() -> None:
    wanted = parse_filter({"status": "dead", "queue": " mail ", "task": "send", "id": "12", "before": "99",
                           "payload": "$.a == 1", "col.tenant_id": "7", "table": "t"}, frozenset({"tenant_id"}))
    assert wanted == JobFilter("dead", "mail", "send", 12, "$.a == 1", {"tenant_id": "7"}, 99)
    assert wanted.query(before=5) == {"status": "dead", "queue": "mail", "task": "send", "id": "12",
                                      "payload": "$.a == 1", "col.tenant_id": "7", "before": "5"}
    assert parse_filter({"status": "", "queue": "  "}, frozenset()) == JobFilter()
    with pytest.raises(FilterError) as refused:
        parse_filter({"col.tenant_id": "7"}, frozenset())
    assert refused.value.parameter == "col.tenant_id"


def test_the_page_words() -> None:
    assert [age(timedelta(seconds=s)) for s in (0.4, 12, 185, 3720, 90000)] == [
        "0.4s", "12s", "3m 05s", "1h 02m", "1d 01h"]
    assert age(None) == "—"
    assert [size(n) for n in (512, 8192, 5 * 1024 * 1024)] == ["512 B", "8.0 kB", "5.0 MB"]



# -- docs/dashboard.md "Mounting it": the block runs, and the mounted app serves under its prefix


def _asgi_get(app: Any, path: str) -> tuple[int, str]:
    """One GET through the ASGI interface itself, as a server would call the app."""
    async def run() -> tuple[int, str]:
        sent: list[dict[str, Any]] = []
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"example.test")], "client": ("127.0.0.1", 1), "server": ("example.test", 80)}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()

    return asyncio.run(run())


@pytest.mark.parametrize("admin", [True, False])
def test_the_mounting_example_serves_under_its_prefix(dashboard_db: tuple[URL, Engine], filled: dict[str, int],
                                                      admin: bool) -> None:
    (block,) = python_blocks(section(DOCS / "dashboard.md", "## Mounting it"))
    namespace: dict[str, Any] = {"engine": dashboard_db[1], "emails": emails, "reports": reports,
                                 "is_admin": lambda request: admin}
    exec(compile(block, "docs/dashboard.md", "exec"), namespace)
    status, html = _asgi_get(namespace["app"], "/queue/jobs")
    if not admin:
        assert status == 403 and "not open to you" in html
        return
    assert status == 200 and 'href="/queue/jobs?status=dead"' in html and "<th>tenant_id</th>" in html
    status, html = _asgi_get(namespace["app"], f"/queue/jobs/report_jobs/{filled['done']}")
    assert status == 200 and 'id="result"' in html


def test_the_periodic_page_shows_last_and_next_ticks(dashboard_db: tuple[URL, Engine], dashboard: str) -> None:
    status, html = get(dashboard, "/periodic")
    assert status == 200 and "no schedule has run on these tables" in html  # no sa_jobqueue_periodic yet
    _, engine = dashboard_db
    create_periodic_table(engine)
    scheduler = PeriodicScheduler(jobs, [Periodic(cron="0 3 * * *", task="cleanup", name="nightly", queue="ops")])
    with Session(engine) as session, session.begin():
        scheduler.run_due(session, now=datetime(2020, 6, 1, 12, 0, tzinfo=timezone.utc))
    status, html = get(dashboard, "/periodic")
    row = re.search(r'<tr data-schedule="nightly">.*?</tr>', html, re.S)
    assert status == 200 and row is not None
    assert "<td>task_jobs</td><td>ops</td>" in row.group(0) and "<code>0 3 * * *</code>" in row.group(0)
    assert "2020-06-01 03:00:00 UTC" in row.group(0) and "2020-06-02 03:00:00 UTC" in row.group(0)
    assert "overdue" in row.group(0)  # the next tick lies in the past of the database's clock: no worker ran it


def test_a_page_the_database_fails_is_a_503_that_says_why(create_database: Callable[[], URL]) -> None:
    from sa_jobqueue.dashboard.views import Views

    empty = create_engine(create_database())  # no job table in it
    try:
        views = Views(empty, [jobs])
        for make in (views.overview, lambda: views.jobs({}), lambda: views.job("task_jobs", "1")):
            page = views.answer(make)
            assert page.status == 503 and 'relation "task_jobs" does not exist' in page.context["message"]
    finally:
        empty.dispose()


def test_the_command_refuses_to_serve_a_table_that_does_not_exist(create_database: Callable[[], URL]) -> None:
    from click.testing import CliRunner

    from sa_jobqueue.cli import main

    url = create_database().set(drivername="postgresql").render_as_string(hide_password=False)
    result = CliRunner().invoke(main, ["dashboard", "--port", "0"], env={"DATABASE_URL": url})
    assert result.exit_code != 0 and "table 'sa_jobqueue_jobs' does not exist" in result.output
