"""Prometheus metrics: counters from the worker signals, queue depth and
latency read from the tables at scrape time (sa_jobqueue/prometheus.py)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from jobapp import TaskJob, jobs
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker
from waiting import wait_for

from sa_jobqueue import JobSpec, RetryPolicy, TaskRegistry, Worker, pause_queue
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker
from sa_jobqueue.prometheus import JobMetrics, QueueCollector


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_counters_follow_what_the_worker_did(engine: Engine, sessions: sessionmaker[Session]) -> None:
    registry = TaskRegistry()

    @registry.task("ok")
    def ok(job: TaskJob) -> None:
        pass

    @registry.task("bad", retry=RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0))
    def bad(job: TaskJob, session: Session) -> None:
        raise RuntimeError("no")

    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("ok", queue="q") for _ in range(4)])
        jobs.enqueue(session, "bad", queue="q", max_attempts=2)
    prom = CollectorRegistry()
    metrics = JobMetrics(prom).connect()
    try:
        Worker(engine, jobs, registry, queues="q", concurrency=2, listen=False).run(until_empty=True)
    finally:
        metrics.disconnect()
    assert _value(prom, "sa_jobqueue_jobs_started_total", task="ok", queue="q") == 4
    assert _value(prom, "sa_jobqueue_jobs_succeeded_total", task="ok", queue="q") == 4
    assert _value(prom, "sa_jobqueue_jobs_started_total", task="bad", queue="q") == 2
    assert _value(prom, "sa_jobqueue_jobs_failed_total", task="bad", queue="q", status="pending") == 1
    assert _value(prom, "sa_jobqueue_jobs_failed_total", task="bad", queue="q", status="dead") == 1
    assert _value(prom, "sa_jobqueue_job_duration_seconds_count", task="ok", queue="q", outcome="succeeded") == 4


def test_reaped_jobs_are_counted(engine: Engine, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop", queue="r"), JobSpec("noop", queue="r", max_attempts=1)])
    with sessions.begin() as session:
        claimed = jobs.claim(session, queues="r", limit=2, lease=timedelta(seconds=60))
        # As if their worker had died a minute ago.
        session.execute(update(TaskJob).where(TaskJob.id.in_([j.id for j in claimed]))
                        .values(lease_expires_at=TaskJob.lease_expires_at - timedelta(minutes=2)))
    prom = CollectorRegistry()
    metrics = JobMetrics(prom).connect()
    try:
        Worker(engine, jobs, TaskRegistry(), queues="nothing-here", listen=False).run(until_empty=True)
    finally:
        metrics.disconnect()
    assert _value(prom, "sa_jobqueue_jobs_reaped_total", table="task_jobs", status="pending") == 1
    assert _value(prom, "sa_jobqueue_jobs_reaped_total", table="task_jobs", status="dead") == 1


def test_queue_depth_and_latency_at_scrape_time(engine: Engine, sessions: sessionmaker[Session]) -> None:
    prom = CollectorRegistry()
    QueueCollector(engine, [jobs]).register(prom)
    assert prom.get_sample_value("sa_jobqueue_jobs", {"table": "task_jobs", "queue": "a", "status": "pending"}) is None
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop", queue="a") for _ in range(3)])
        jobs.enqueue(session, "noop", queue="b", delay=3600)  # not runnable: no latency
    time.sleep(0.05)
    assert _value(prom, "sa_jobqueue_jobs", table="task_jobs", queue="a", status="pending") == 3
    assert _value(prom, "sa_jobqueue_jobs", table="task_jobs", queue="b", status="pending") == 1
    assert _value(prom, "sa_jobqueue_oldest_runnable_age_seconds", table="task_jobs", queue="a") > 0
    assert prom.get_sample_value(
        "sa_jobqueue_oldest_runnable_age_seconds", {"table": "task_jobs", "queue": "b"}
    ) is None


@pytest.mark.anyio
async def test_the_asyncio_worker_feeds_the_same_counters(async_engine: AsyncEngine) -> None:
    """AsyncWorker sends the worker signals the thread worker sends: async
    handlers with and without the job's AsyncSession, a failure retried, then dead."""
    registry = TaskRegistry()

    @registry.task("ok")
    async def ok(job: TaskJob) -> None:
        pass

    @registry.task("ok_in_session")
    async def ok_in_session(job: TaskJob, session: AsyncSession) -> None:
        pass

    @registry.task("bad", retry=RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0))
    async def bad(job: TaskJob, session: AsyncSession) -> None:
        raise RuntimeError("no")

    sessions = async_sessionmaker(async_engine, expire_on_commit=False)
    async_jobs = AsyncJobRepository(TaskJob)
    async with sessions.begin() as session:
        await async_jobs.enqueue_many(session, [JobSpec("ok", queue="q") for _ in range(3)]
                                      + [JobSpec("ok_in_session", queue="q")])
        await async_jobs.enqueue(session, "bad", queue="q", max_attempts=2)
    prom = CollectorRegistry()
    metrics = JobMetrics(prom).connect()
    try:
        await AsyncWorker(sessions, async_jobs, registry, queues="q", concurrency=2, listen=False).run(
            until_empty=True, handle_signals=False)
    finally:
        metrics.disconnect()
    assert _value(prom, "sa_jobqueue_jobs_started_total", task="ok", queue="q") == 3
    assert _value(prom, "sa_jobqueue_jobs_succeeded_total", task="ok", queue="q") == 3
    assert _value(prom, "sa_jobqueue_jobs_succeeded_total", task="ok_in_session", queue="q") == 1
    assert _value(prom, "sa_jobqueue_jobs_started_total", task="bad", queue="q") == 2
    assert _value(prom, "sa_jobqueue_jobs_failed_total", task="bad", queue="q", status="pending") == 1
    assert _value(prom, "sa_jobqueue_jobs_failed_total", task="bad", queue="q", status="dead") == 1
    assert _value(prom, "sa_jobqueue_job_duration_seconds_count", task="ok", queue="q", outcome="succeeded") == 3


def test_live_workers_and_paused_queues_at_scrape_time(engine: Engine, sessions: sessionmaker[Session]) -> None:
    prom = CollectorRegistry()
    QueueCollector(engine, [jobs]).register(prom)
    assert _value(prom, "sa_jobqueue_workers_alive", table="task_jobs") == 0
    with sessions.begin() as session:
        pause_queue(session, jobs, "newsletters")
    assert _value(prom, "sa_jobqueue_queue_paused", table="task_jobs", queue="newsletters") == 1
    worker = Worker(engine, jobs, TaskRegistry(), poll_interval=0.05, listen=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: _value(prom, "sa_jobqueue_workers_alive", table="task_jobs") == 1, 30, "the live worker")
    finally:
        worker.stop()
        thread.join(timeout=30)
    wait_for(lambda: _value(prom, "sa_jobqueue_workers_alive", table="task_jobs") == 0, 30, "the worker withdrawn")
