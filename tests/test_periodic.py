"""Periodic jobs on a real PostgreSQL: registration, exactly-once ticks, catch-up, and a Worker.

Time is deterministic: the tests hand ``run_due`` an explicit ``now`` instead
of waiting for real minutes; only the end-to-end test uses the database clock,
with a schedule that fires every second.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import jobapp
import pytest
from jobapp import TaskJob, jobs
from sqlalchemy import Engine, create_engine, delete, func, select, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker

from sa_jobqueue import (
    InvalidArgumentError,
    Periodic,
    PeriodicScheduler,
    TaskRegistry,
    Worker,
    create_periodic_table,
)
from sa_jobqueue import periodic as periodic_module
from sa_jobqueue.periodic import PERIODIC

T0 = datetime(2026, 11, 30, 12, 0, 30, tzinfo=timezone.utc)  # between two ticks of */5


@pytest.fixture
def periodic_table(engine: Engine) -> Iterator[None]:
    create_periodic_table(engine)
    yield
    with engine.begin() as conn:
        conn.execute(delete(PERIODIC))


def noop(job: TaskJob) -> None:
    pass


def registry_with(*schedules: tuple[str, dict[str, Any]]) -> TaskRegistry:
    registry = TaskRegistry()
    registry.register("tick", noop)
    for cron, options in schedules:
        registry.schedule(cron, "tick", **options)
    return registry


def run_due(sessions: sessionmaker[Session], scheduler: PeriodicScheduler, now: datetime) -> list[TaskJob]:
    with sessions() as session, session.begin():
        return scheduler.run_due(session, now=now)


def all_jobs(sessions: sessionmaker[Session]) -> list[TaskJob]:
    with sessions() as session:
        return list(session.scalars(select(TaskJob).order_by(TaskJob.run_at, TaskJob.id)))


# --------------------------------------------------------------------------- registration


@pytest.mark.parametrize(
    "cron",
    ["* * * *", "61 * * * *", "*/0 * * * *", "abc", "", "* * * * * * *", "0 0 31 2 *", 5, None],
)
def test_invalid_cron_expressions_are_refused_at_registration(cron: Any) -> None:
    registry = TaskRegistry()
    registry.register("tick", noop)
    with pytest.raises(InvalidArgumentError) as raised:
        registry.schedule(cron, "tick")
    assert raised.value.parameter == "cron"
    with pytest.raises(InvalidArgumentError) as raised:
        registry.periodic(cron)
    assert raised.value.parameter == "cron"
    assert registry.periodic_tasks == []


@pytest.mark.parametrize(
    ("options", "parameter"),
    [
        ({"catch_up": 1}, "catch_up"),
        ({"queue": ""}, "queue"),
        ({"priority": 40000}, "priority"),
        ({"payload": {"x": float("nan")}}, "payload"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_schedule_options_name_the_parameter(options: dict[str, Any], parameter: str) -> None:
    registry = TaskRegistry()
    registry.register("tick", noop)
    with pytest.raises(InvalidArgumentError) as raised:
        registry.schedule("* * * * *", "tick", **options)
    assert raised.value.parameter == parameter
    with pytest.raises(InvalidArgumentError) as raised:
        registry.periodic("* * * * *", **options)
    assert raised.value.parameter == parameter


def test_valid_expressions_and_the_decorator_in_either_order() -> None:
    registry = TaskRegistry()

    @registry.periodic("*/5 * * * *", payload={"kind": "digest"})
    @registry.task("digest")
    def send_digest(job: TaskJob) -> None: ...

    @registry.task
    @registry.periodic("@hourly", queue="reports", catch_up=True)
    def hourly(job: TaskJob, session: Session) -> None: ...

    registry.schedule("* * * * * */10", "digest", name="digest-fast")
    entries = registry.periodic_tasks
    assert [(e.cron, e.task, e.name, e.queue, e.catch_up) for e in entries] == [
        ("*/5 * * * *", "digest", "digest", "default", False),
        ("* * * * * */10", "digest", "digest-fast", "default", False),
        ("@hourly", "hourly", "hourly", "reports", True),
    ]
    assert entries[0].payload == {"kind": "digest"}
    # The second schedule of a task on a queue needs a name of its own.
    with pytest.raises(InvalidArgumentError) as raised:
        registry.schedule("0 * * * *", "digest")
    assert raised.value.parameter == "name"


def test_a_periodic_handler_that_is_never_registered_is_reported() -> None:
    registry = TaskRegistry()

    @registry.periodic("* * * * *")
    def orphan(job: TaskJob) -> None: ...

    with pytest.raises(InvalidArgumentError) as raised:
        registry.periodic_tasks  # noqa: B018
    assert raised.value.parameter == "handler"


def test_ticks_are_utc_and_six_fields_mean_seconds() -> None:
    entry = Periodic(cron="*/5 * * * *", task="tick", name="tick")
    assert entry.latest_tick(T0) == datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    assert entry.latest_tick(datetime(2026, 11, 30, 12, 5, tzinfo=timezone.utc)) == datetime(
        2026, 11, 30, 12, 5, tzinfo=timezone.utc
    )
    seconds = Periodic(cron="* * * * * */10", task="tick", name="tick")
    assert seconds.ticks_after(T0, T0 + timedelta(seconds=30), 10) == [
        T0 + timedelta(seconds=10), T0 + timedelta(seconds=20), T0 + timedelta(seconds=30)
    ]


# --------------------------------------------------------------------------- exactly once


def test_each_tick_once_even_after_its_job_is_deleted(
    periodic_table: None, sessions: sessionmaker[Session]
) -> None:
    registry = registry_with(("*/5 * * * *", {"payload": {"kind": "digest"}}))
    scheduler = PeriodicScheduler(jobs, registry)
    # First sighting: the schedule records its latest tick, owes nothing before it.
    assert run_due(sessions, scheduler, T0) == []
    assert all_jobs(sessions) == []

    tick = datetime(2026, 11, 30, 12, 5, tzinfo=timezone.utc)
    (job,) = run_due(sessions, scheduler, tick + timedelta(seconds=3))
    assert (job.task, job.queue, job.payload, job.run_at) == ("tick", "default", {"kind": "digest"}, tick)
    assert Periodic.tick_of(job) == tick
    # The same tick again, from this scheduler or a fresh one (another worker): nothing.
    assert run_due(sessions, scheduler, tick + timedelta(seconds=30)) == []
    assert run_due(sessions, PeriodicScheduler(jobs, registry), tick + timedelta(seconds=30)) == []
    # The job finished and was deleted: the repository's dedupe no longer covers
    # the tick, the periodic table still does.
    with sessions() as session, session.begin():
        session.execute(delete(TaskJob))
    assert run_due(sessions, PeriodicScheduler(jobs, registry), tick + timedelta(seconds=59)) == []
    assert all_jobs(sessions) == []
    # The next tick comes once.
    (later,) = run_due(sessions, PeriodicScheduler(jobs, registry), tick + timedelta(minutes=5))
    assert later.run_at == tick + timedelta(minutes=5)


def test_a_rolled_back_pass_takes_no_tick(periodic_table: None, sessions: sessionmaker[Session]) -> None:
    registry = registry_with(("*/5 * * * *", {}))
    assert run_due(sessions, PeriodicScheduler(jobs, registry), T0) == []
    now = T0 + timedelta(minutes=5)
    with sessions() as session, session.begin():
        assert len(PeriodicScheduler(jobs, registry).run_due(session, now=now)) == 1
        session.rollback()
    assert all_jobs(sessions) == []
    assert len(run_due(sessions, PeriodicScheduler(jobs, registry), now)) == 1


@pytest.mark.parametrize("catch_up", [False, True])
def test_racing_schedulers_enqueue_each_tick_once(
    periodic_table: None, sessions: sessionmaker[Session], catch_up: bool
) -> None:
    """Eight schedulers (one per worker) run the due-pass for the same ticks at once."""
    registry = registry_with(("*/5 * * * *", {"catch_up": catch_up}))
    racers = 8
    schedulers = [PeriodicScheduler(jobs, registry) for _ in range(racers)]
    barrier = threading.Barrier(racers, timeout=30)
    errors: list[BaseException] = []
    # What each pass enqueued: the jobs' dedupe keys would fold duplicates of a
    # live job into one row, so count what the passes report, not only rows.
    enqueued: list[datetime] = []

    def race(scheduler: PeriodicScheduler, now: datetime) -> None:
        try:
            with sessions() as session, session.begin():
                # Hold the transaction open until every racer has one.
                session.execute(text("SELECT 1"))
                barrier.wait()
                enqueued.extend(job.run_at for job in scheduler.run_due(session, now=now))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def round_at(now: datetime, *others: datetime) -> None:
        """Every racer at ``now``, or round-robin over ``now`` and ``others``."""
        nows = [now, *others]
        threads = [threading.Thread(target=race, args=(s, nows[i % len(nows)])) for i, s in enumerate(schedulers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive()
        barrier.reset()
        assert errors == []

    round_at(T0)  # concurrent first sightings: one row, no job
    assert all_jobs(sessions) == []
    for minutes in (5, 10, 25):  # 25: a gap of three ticks
        round_at(T0 + timedelta(minutes=minutes))
    ticks = [job.run_at for job in all_jobs(sessions)]
    expected_minutes = [5, 10, 15, 20, 25] if catch_up else [5, 10, 25]
    expected = [datetime(2026, 11, 30, 12, m, tzinfo=timezone.utc) for m in expected_minutes]
    assert ticks == expected
    assert sorted(enqueued) == expected

    # Racers whose clocks read differently: a racer that read the old last tick
    # must not enqueue after one with an earlier now moved it (compare-and-set).
    enqueued.clear()
    round_at(T0 + timedelta(minutes=35), T0 + timedelta(minutes=45))
    round_at(T0 + timedelta(minutes=45))
    expected_minutes = [30, 35, 40, 45] if catch_up else [45]
    if not catch_up and len(enqueued) == 2:
        expected_minutes = [35, 45]  # the 12:35 racer came first; 12:45 is the next tick due
    expected = [datetime(2026, 11, 30, 12, m, tzinfo=timezone.utc) for m in expected_minutes]
    assert sorted(enqueued) == expected


def test_a_pass_that_read_an_older_tick_enqueues_nothing(
    periodic_table: None, sessions: sessionmaker[Session]
) -> None:
    """Worker B (clock at 12:35) moves the tick while worker A (12:45, catching
    up) waits on the row: A's compare-and-set fails, its ticks come next pass."""
    registry = registry_with(("*/5 * * * *", {"catch_up": True}))
    assert run_due(sessions, PeriodicScheduler(jobs, registry), T0 + timedelta(minutes=25)) == []
    a_jobs: list[TaskJob] = []
    with sessions() as b_session:
        b_session.begin()
        b_jobs = PeriodicScheduler(jobs, registry).run_due(b_session, now=T0 + timedelta(minutes=35))
        assert [job.run_at.minute for job in b_jobs] == [30, 35]  # uncommitted: B holds the row

        def worker_a() -> None:
            a_jobs.extend(run_due(sessions, PeriodicScheduler(jobs, registry), T0 + timedelta(minutes=45)))

        a = threading.Thread(target=worker_a)
        a.start()
        a.join(timeout=0.5)
        assert a.is_alive()  # A read the old tick and now waits for B's row lock
        b_session.commit()
        a.join(timeout=30)
        assert not a.is_alive()
    assert a_jobs == []
    later = run_due(sessions, PeriodicScheduler(jobs, registry), T0 + timedelta(minutes=45))
    assert [job.run_at.minute for job in later] == [40, 45]
    assert [job.run_at.minute for job in all_jobs(sessions)] == [30, 35, 40, 45]


# --------------------------------------------------------------------------- missed ticks


def test_catch_up_enqueues_every_missed_tick_skip_only_the_latest(
    periodic_table: None, sessions: sessionmaker[Session]
) -> None:
    registry = registry_with(
        ("*/5 * * * *", {"name": "skip"}),
        ("*/5 * * * *", {"name": "catch-up", "catch_up": True}),
    )
    skip, catch_up = registry.periodic_tasks
    scheduler = PeriodicScheduler(jobs, registry)
    assert run_due(sessions, scheduler, T0) == []
    # An hour of downtime: twelve ticks, 12:05 … 13:00.
    enqueued = run_due(sessions, scheduler, T0 + timedelta(hours=1))
    by_schedule: dict[str, list[datetime]] = {}
    for job in enqueued:
        tick = Periodic.tick_of(job)
        assert tick is not None and job.run_at == tick
        by_schedule.setdefault(job.dedupe_key.split("@")[0], []).append(tick)
    first = datetime(2026, 11, 30, 12, 5, tzinfo=timezone.utc)
    assert by_schedule["periodic:skip"] == [datetime(2026, 11, 30, 13, 0, tzinfo=timezone.utc)]
    assert by_schedule["periodic:catch-up"] == [first + timedelta(minutes=5 * i) for i in range(12)]
    assert len(all_jobs(sessions)) == 13


def test_catch_up_is_bounded_per_pass(
    periodic_table: None, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(periodic_module, "MAX_CATCH_UP", 5)
    registry = registry_with(("* * * * *", {"catch_up": True}))
    scheduler = PeriodicScheduler(jobs, registry)
    assert run_due(sessions, scheduler, T0) == []
    now = T0 + timedelta(minutes=12)  # twelve missed ticks
    assert [len(run_due(sessions, scheduler, now)) for _ in range(4)] == [5, 5, 2, 0]
    ticks = [job.run_at for job in all_jobs(sessions)]
    assert ticks == [datetime(2026, 11, 30, 12, 1, tzinfo=timezone.utc) + timedelta(minutes=i) for i in range(12)]


def test_the_database_clock_decides_when_now_is_not_given(
    periodic_table: None, sessions: sessionmaker[Session]
) -> None:
    registry = registry_with(("* * * * *", {}))
    scheduler = PeriodicScheduler(jobs, registry)
    with sessions() as session, session.begin():
        assert scheduler.run_due(session) == []
        db_now = session.execute(select(func.now())).scalar_one()
        last = session.execute(select(PERIODIC.c.last_tick)).scalar_one()
    assert last == db_now.replace(second=0, microsecond=0)


def test_a_worker_schedules_only_the_queues_it_serves(engine: Engine) -> None:
    registry = registry_with(("* * * * *", {"queue": "elsewhere"}))
    # The worker builds its periodic pass from the schedules of its own queues.
    assert not PeriodicScheduler(jobs, registry, queues=["default"])
    assert PeriodicScheduler(jobs, registry, queues=["elsewhere"])
    with pytest.raises(InvalidArgumentError) as raised:
        Worker(engine, jobs, registry, periodic_interval=0)
    assert raised.value.parameter == "periodic_interval"


# --------------------------------------------------------------------------- end to end


def test_a_worker_enqueues_and_runs_a_periodic_job(periodic_table: None, engine: Engine) -> None:
    registry = TaskRegistry()
    ran: list[datetime | None] = []
    done = threading.Event()

    @registry.periodic("* * * * * *")  # every second
    @registry.task
    def every_second(job: TaskJob) -> None:
        ran.append(Periodic.tick_of(job))
        done.set()

    worker = Worker(engine, jobs, registry, poll_interval=0.1, periodic_interval=0.1, listen=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        # The first pass records the current second; the next second's tick runs.
        assert done.wait(timeout=15), "no periodic job ran"
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert ran and ran[0] is not None
    assert len(ran) == len(set(ran))  # one job per tick
    assert worker.result.completed >= 1


def test_a_worker_without_the_periodic_table_logs_once_and_runs_jobs(
    create_database: Callable[[], URL], caplog: pytest.LogCaptureFixture
) -> None:
    engine = create_engine(create_database())
    try:
        jobapp.Base.metadata.create_all(engine)  # the job tables, not sa_jobqueue_periodic
        registry = registry_with(("* * * * * *", {}))
        with Session(engine) as session, session.begin():
            jobs.enqueue(session, "tick")
        worker = Worker(engine, jobs, registry, poll_interval=0.05, periodic_interval=0.05, listen=False)
        done = threading.Event()
        thread = threading.Thread(target=lambda: (worker.run(), done.set()))
        with caplog.at_level(logging.ERROR, logger="sa_jobqueue.worker"):
            thread.start()
            try:
                pause = threading.Event()  # never set: a bounded sleep
                for _ in range(200):  # at most 10 s for the job; passes fail meanwhile
                    if worker.result.completed:
                        break
                    pause.wait(0.05)
                pause.wait(0.3)  # a few more failing passes: still one log record
            finally:
                worker.stop()
                thread.join(timeout=30)
        assert done.is_set()
        assert worker.result.completed == 1
        failures = [r for r in caplog.records if "periodic pass failed" in r.getMessage()]
        assert len(failures) == 1
    finally:
        engine.dispose()
