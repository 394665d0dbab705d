"""Results (sa_jobqueue.results): what a handler returns is stored with its job's completion on
tables that keep finished jobs, in both workers, both modes and grouped commits; read_result
gives it back or the job's error; wait_for_result wakes on the NOTIFY of its commit."""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
from jobapp import Ledger, ReportJob, TaskJob
from sqlalchemy import Engine, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from sa_jobqueue import (
    InvalidArgumentError,
    JobContext,
    JobFailedError,
    JobNotFoundError,
    JobRepository,
    ResultNotReadyError,
    ResultTimeoutError,
    RetryPolicy,
    TaskRegistry,
    Worker,
    read_result,
    wait_for_result,
)
from sa_jobqueue import aio as sa_aio
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker

reports = JobRepository(ReportJob)
jobs = JobRepository(TaskJob)
QUICK = RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0)


def _registry() -> TaskRegistry:
    registry = TaskRegistry(repository=reports)

    @registry.task
    def add(x: int, y: int) -> int:  # no session: its completion carries the result
        return x + y

    @registry.task
    def summarise(ctx: JobContext, session: Session, words: list[str]) -> dict[str, Any]:
        session.add(Ledger(job_id=ctx.id, note="summarised"))
        return {"count": len(words), "first": words[0] if words else None}

    @registry.task
    def maybe(flag: bool) -> int | None:  # annotated: None is stored too
        return 1 if flag else None

    @registry.task
    def nothing() -> None:
        pass

    @registry.task(max_attempts=1)
    def unencodable() -> object:
        return {1, 2}

    @registry.task(max_attempts=2, retry=QUICK)
    def broken() -> int:
        raise ValueError("no such report")

    return registry


def _drain(engine: Engine, registry: TaskRegistry, repository: Any = reports, **options: Any) -> None:
    Worker(engine, repository, registry, listen=False, poll_interval=0.05, **options).run(until_empty=True)


def _stored(engine: Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT result IS NULL, result FROM report_jobs WHERE id = :id"),
                            {"id": job_id}).one()


@pytest.mark.parametrize(("mode", "options"), [("lease", {}), ("transaction", {"batch_size": 10})])
def test_results_are_stored_with_the_completion(engine: Engine, mode: str, options: dict[str, Any]) -> None:
    registry = _registry()
    tasks = {t.name: t for t in registry}
    with Session(engine) as session, session.begin():
        added = tasks["add"].enqueue(session, 2, 3)
        summary = tasks["summarise"].enqueue(session, ["a", "b"])
        none_kept = tasks["maybe"].enqueue(session, False)
        one = tasks["maybe"].enqueue(session, True)
        silent = tasks["nothing"].enqueue(session)
        bad = tasks["unencodable"].enqueue(session)
        failing = tasks["broken"].enqueue(session)
        waiting = tasks["add"].configure(delay=3600).enqueue(session, 1, 1)
    _drain(engine, registry, mode=mode, **options)
    with Session(engine) as session:
        assert read_result(session, ReportJob, added.id) == 5
        assert tasks["add"].result(session, added.id) == 5
        assert read_result(session, ReportJob, summary.id) == {"count": 2, "first": "a"}
        assert read_result(session, ReportJob, none_kept.id) is None
        assert read_result(session, ReportJob, one.id) == 1
        assert read_result(session, ReportJob, silent.id) is None
        with pytest.raises(JobFailedError) as failed:
            read_result(session, ReportJob, failing.id)
        assert failed.value.status == "dead" and "no such report" in str(failed.value)
        with pytest.raises(JobFailedError) as refused:
            read_result(session, ReportJob, bad.id)
        assert "result: is not JSON serializable" in (refused.value.error or "")
        with pytest.raises(ResultNotReadyError):
            read_result(session, ReportJob, waiting.id)
        with pytest.raises(JobNotFoundError):
            read_result(session, ReportJob, 10**9)
        assert session.scalars(select(Ledger.job_id)).all() == [summary.id]  # the handler's write, once
    assert _stored(engine, none_kept.id) == (False, None)  # JSON null: the task is annotated to return a value
    assert _stored(engine, silent.id) == (True, None)  # SQL NULL: it returns nothing, nothing is written


def test_grouped_commits_store_each_jobs_result(engine: Engine) -> None:
    registry = TaskRegistry(repository=reports)

    @registry.task(group_commit=True)
    def square(ctx: JobContext, session: Session, n: int) -> int:
        session.add(Ledger(job_id=ctx.id, note=str(n)))
        return n * n

    with Session(engine) as session, session.begin():
        made = reports.enqueue_many(session, [square.spec(n) for n in range(10)])
    _drain(engine, registry, batch_size=10)
    with Session(engine) as session:
        assert [read_result(session, ReportJob, j.id) for j in made] == [n * n for n in range(10)]


def test_a_table_that_deletes_finished_jobs_keeps_no_result_and_says_so(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = TaskRegistry(repository=jobs)

    @registry.task
    def compute(n: int) -> int:
        return n + 1

    with Session(engine) as session, session.begin():
        job = compute.enqueue(session, 1)
    with caplog.at_level(logging.WARNING, logger="sa_jobqueue.worker"):
        _drain(engine, registry, repository=jobs)
    assert "does not keep finished jobs" in caplog.text
    with Session(engine) as session, pytest.raises(JobNotFoundError):
        read_result(session, TaskJob, job.id)


def test_wait_for_result_wakes_on_the_commit(engine: Engine) -> None:
    """A poll interval far past the timeout: only the NOTIFY can deliver the result in time."""
    registry = _registry()
    add = registry.get("add")
    assert add is not None
    with Session(engine) as session, session.begin():
        job = add.enqueue(session, 20, 22)  # type: ignore[attr-defined]
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(
        wait_for_result(engine, ReportJob, job.id, timeout=60, poll_interval=3600)))
    waiter.start()
    _drain(engine, registry)
    waiter.join(90)
    assert got == [42]


def test_wait_for_result_raises_the_jobs_failure_and_times_out(engine: Engine) -> None:
    registry = _registry()
    broken = registry.get("broken")
    assert broken is not None
    with Session(engine) as session, session.begin():
        job = broken.enqueue(session)  # type: ignore[attr-defined]
        pending = reports.enqueue(session, "add", {"x": 1, "y": 1}, delay=3600)
    _drain(engine, registry)
    with pytest.raises(JobFailedError):
        wait_for_result(engine, ReportJob, job.id, timeout=30, poll_interval=0.05)
    with pytest.raises(ResultTimeoutError):
        wait_for_result(engine, ReportJob, pending.id, timeout=0.2, poll_interval=0.05)
    for bad, parameter in [({"timeout": 0}, "timeout"), ({"timeout": 1, "poll_interval": -1}, "poll_interval")]:
        with pytest.raises(InvalidArgumentError) as raised:
            wait_for_result(engine, ReportJob, job.id, **bad)
        assert raised.value.parameter == parameter
    with pytest.raises(InvalidArgumentError) as raised:
        wait_for_result(engine, Ledger, job.id, timeout=1)
    assert raised.value.parameter == "model"


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["lease", "transaction"])
async def test_the_asyncio_worker_stores_results_and_the_async_wait_gets_them(
    async_engine: AsyncEngine, engine: Engine, mode: str
) -> None:
    repository = AsyncJobRepository(ReportJob)
    registry = TaskRegistry(repository=repository)

    @registry.task
    async def shout(ctx: JobContext, session: AsyncSession, word: str) -> str:
        session.add(Ledger(job_id=ctx.id, note=word))
        return word.upper()

    @registry.task
    async def length(word: str) -> int:
        return len(word)

    sessions = async_sessionmaker(async_engine, expire_on_commit=False)
    async with sessions.begin() as session:
        loud = await shout.enqueue_async(session, "hey")
        counted = await length.enqueue_async(session, "four")
    waiting = asyncio.ensure_future(sa_aio.wait_for_result(async_engine, ReportJob, loud.id, timeout=60,
                                                           poll_interval=3600))
    await AsyncWorker(async_engine, repository, registry, sync_bind=engine, mode=mode, listen=False,
                      poll_interval=0.05).run(until_empty=True)
    assert await asyncio.wait_for(waiting, 90) == "HEY"
    async with sessions() as session:
        assert await sa_aio.read_result(session, ReportJob, counted.id) == 4
