"""The dashboard in a real browser: Debian's Chromium, driven by Playwright, against
``sa-jobqueue dashboard`` on loopback and a real PostgreSQL (docs/dashboard.md).

The pages render with data, a filter narrows the list, a page updates by
itself when a job is enqueued elsewhere, the Workers page shows a running
job's progress, a queue pauses from the overview, and the Dead and Periodic
pages open from the menu. Screenshots of each page go to the
test's directory (and, with ``SAJQ_SCREENSHOTS=DIR``, to DIR: how
docs/img/dashboard-*.png are made). Skipped, saying why, without Chromium
(``apt-get install chromium``; .ci/run installs it).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from dashboard_server import serving
from jobapp import Base, EmailJob, ReportJob, emails, jobs, reports
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from sa_jobqueue import (
    JobSpec,
    Periodic,
    PeriodicScheduler,
    TaskRegistry,
    Worker,
    create_control_tables,
    create_periodic_table,
    paused_queues,
    report_progress,
)
from sa_jobqueue.throughput import add_finished

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TIMEOUT_MS = 30_000
LEASE = timedelta(seconds=60)

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="Chromium is not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def database(create_database: Callable[[], URL]) -> Iterator[tuple[URL, Engine]]:
    url = create_database()
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    create_control_tables(engine)
    with Session(engine) as session, session.begin():
        jobs.enqueue_many(session, [JobSpec("send_invoice", {"invoice": n}, queue="billing") for n in range(30)])
        jobs.enqueue_many(session, [JobSpec("resize", {"image": n}, queue="media", priority=-1) for n in range(12)])
        jobs.enqueue(session, "nightly_report", {"day": "2026-12-02"}, delay=timedelta(hours=6))
        emails.enqueue(session, "send_welcome", {"user_id": 42}, extra={"tenant_id": 7})
        reports.enqueue_many(session, [JobSpec("monthly", {"month": m}) for m in range(1, 9)])
    with Session(engine) as session, session.begin():
        claimed = reports.claim(session, limit=8, lease=LEASE)
        for job in claimed[:6]:
            reports.complete(session, job)
        reports.fail(session, claimed[6], "Traceback (most recent call last):\n  File \"reports.py\", line 12, "
                     "in monthly\nValueError: no data for month 7", discard=True)
        add_finished(session, {("report_jobs", "default"): [6, 1]})  # as the workers' beats count them
    yield url, engine
    engine.dispose()


@pytest.fixture(scope="module")
def address(database: tuple[URL, Engine]) -> Iterator[str]:
    # A poll interval far longer than the waits below: a page that updates in time was told by NOTIFY.
    with serving(database[0], "--poll-interval", "600") as served:
        yield served


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)  # a busy machine: wait for a state, up to this long
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(TIMEOUT_MS)
    yield opened
    context.close()


def _shoot(page: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0
    wanted = os.environ.get("SAJQ_SCREENSHOTS")
    if wanted:
        shutil.copy(path, Path(wanted) / path.name)


def test_the_overview_renders_with_data(page: Any, address: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    page.goto(f"http://{address}/")
    expect(page.locator("h1")).to_have_text("Overview")
    billing = page.locator('section[data-table="task_jobs"] tr[data-queue="billing"] td[data-status="pending"]')
    expect(billing).to_have_text("30")
    report = page.locator('section[data-table="report_jobs"]')
    expect(report.locator("svg.chart rect").first).to_be_attached()
    expect(report).to_contain_text("6 done, 1 failed in the last hour")
    _shoot(page, tmp_path, "overview")


def test_a_filter_narrows_the_list_and_a_job_opens(page: Any, address: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    page.goto(f"http://{address}/jobs")
    rows = page.locator("#jobs tbody tr[data-job]")
    expect(rows).to_have_count(43)
    page.fill('input[name="queue"]', "media")
    page.click("button[type=submit]")
    expect(rows).to_have_count(12)
    expect(page.locator("#jobs tbody")).not_to_contain_text("send_invoice")
    _shoot(page, tmp_path, "jobs")
    page.select_option('select[name="table"]', "report_jobs")
    page.fill('input[name="queue"]', "")
    page.select_option('select[name="status"]', "dead")
    page.click("button[type=submit]")
    expect(rows).to_have_count(1)
    rows.first.locator("a").click()
    expect(page.locator("#last-error")).to_contain_text("ValueError: no data for month 7")
    expect(page.locator("#payload")).to_contain_text('"month": 7')
    _shoot(page, tmp_path, "job")


def test_a_bad_filter_shows_its_message(page: Any, address: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"http://{address}/jobs")
    page.fill('input[name="payload"]', "$.image ==")
    page.click("button[type=submit]")
    expect(page.locator('[role="alert"]')).to_contain_text("payload: not a SQL/JSON path")


def test_the_page_updates_when_a_job_is_enqueued_elsewhere(
    page: Any, address: str, database: tuple[URL, Engine], tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    page.goto(f"http://{address}/jobs?queue=live")
    expect(page.locator("body[data-live-open]")).to_be_attached()  # the event stream is open
    rows = page.locator("#jobs tbody tr[data-job]")
    expect(rows).to_have_count(0)
    with Session(database[1]) as session, session.begin():
        job = jobs.enqueue(session, "arrived_live", {"n": 1}, queue="live")
    expect(page.locator(f'#jobs tr[data-job="{job.id}"]')).to_contain_text("arrived_live")
    page.goto(f"http://{address}/jobs?status=scheduled")
    expect(rows).to_have_count(1)
    _shoot(page, tmp_path, "scheduled")


def test_an_action_changes_the_database(page: Any, address: str, database: tuple[URL, Engine],
                                        tmp_path: Path) -> None:
    from playwright.sync_api import expect

    page.goto(f"http://{address}/jobs?table=report_jobs&status=dead")
    page.locator("#jobs tbody tr[data-job] a").first.click()
    job_id = int(page.url.rsplit("/", 1)[1])
    page.click('a.action[data-action="retry"]')
    expect(page.locator("h1")).to_have_text("Retry 1 job(s)?")
    _shoot(page, tmp_path, "confirm")
    page.click("#confirm")
    expect(page.locator("#outcome")).to_contain_text("1 job(s) changed")
    with Session(database[1]) as session:
        assert session.get(ReportJob, job_id).status == "pending"  # type: ignore[union-attr]


def test_the_workers_page_shows_a_running_job_and_a_queue_pauses_from_the_overview(
    page: Any, address: str, database: tuple[URL, Engine], tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    registry, release = TaskRegistry(), threading.Event()

    @registry.task
    def export_contacts(job: EmailJob) -> None:
        report_progress(job, 0.62, "contacts 6,200 of 10,000")
        release.wait(120)

    with Session(database[1]) as session, session.begin():
        job_id = emails.enqueue(session, "export_contacts", queue="exports").id
    worker = Worker(database[1], emails, registry, queues=["exports"], poll_interval=0.05, name="web-1:4242",
                    heartbeat_interval=timedelta(seconds=0.2), lease=timedelta(seconds=5))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        page.goto(f"http://{address}/workers")
        # The page refreshes itself every poll interval, which is long here: reload until the beat shows the job.
        running = page.locator(f'tr[data-job="{job_id}"] td.progress')
        for _ in range(60):
            if running.count():
                break
            page.wait_for_timeout(500)
            page.reload()
        expect(running).to_contain_text("62% contacts 6,200 of 10,000")
        expect(page.locator('tr[data-worker="web-1:4242"]')).to_contain_text("alive")
        _shoot(page, tmp_path, "workers")
    finally:
        release.set()
        worker.stop()
        thread.join(timeout=60)
    page.goto(f"http://{address}/")
    row = page.locator('section[data-table="email_jobs"] tr[data-queue="default"]')
    row.locator('a[data-queue-operation="pause"]').click()
    expect(page.locator("h1")).to_have_text("Pause queue default of email_jobs?")
    page.click("#confirm")
    expect(page.locator("#outcome")).to_contain_text("Paused")
    page.goto(f"http://{address}/")
    expect(row.locator('[data-paused="default"]')).to_have_text("paused")
    with Session(database[1]) as session:
        assert paused_queues(session) == {"email_jobs": {"default"}}


def test_the_dead_and_periodic_pages_open_from_the_menu(page: Any, address: str, database: tuple[URL, Engine],
                                                         tmp_path: Path) -> None:
    """Last in this module: its periodic tick enqueues a job the counts above do not expect."""
    from playwright.sync_api import expect

    _, engine = database
    with Session(engine) as session, session.begin():
        reports.enqueue(session, "quarterly", {"quarter": 3}, queue="archive")
    with Session(engine) as session, session.begin():
        [job] = reports.claim(session, queues=["archive"], lease=LEASE)
        reports.fail(session, job, "Traceback (most recent call last):\n  File \"reports.py\", line 30, in "
                     "quarterly\nKeyError: 'q3'", discard=True)
    create_periodic_table(engine)
    scheduler = PeriodicScheduler(jobs, [Periodic(cron="0 3 * * *", task="nightly_report", name="nightly",
                                                  queue="ops")])
    with Session(engine) as session, session.begin():
        scheduler.run_due(session, now=datetime(2020, 6, 1, 12, 0, tzinfo=timezone.utc))

    page.goto(f"http://{address}/")
    page.click('header a:text-is("Dead")')
    expect(page.locator("h1")).to_have_text("Dead jobs")
    page.select_option('select[name="table"]', "report_jobs")
    page.click("button[type=submit]")
    expect(page.locator(f'#jobs tr[data-job="{job.id}"]')).to_contain_text("quarterly")
    _shoot(page, tmp_path, "dead")
    page.click('header a:text-is("Periodic")')
    expect(page.locator("h1")).to_have_text("Periodic schedules")
    schedule = page.locator('tr[data-schedule="nightly"]')
    expect(schedule).to_contain_text("2020-06-01 03:00:00 UTC")
    expect(schedule).to_contain_text("overdue")  # the next tick lies in the past: no worker ran it
    _shoot(page, tmp_path, "periodic")
