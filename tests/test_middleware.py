"""Middleware (sa_jobqueue.middleware): an ordered chain of context managers around every
handler, in the thread worker and the asyncio worker, in both modes; it sees the job before
and the outcome after, sets context variables and per-transaction database settings, and its
failures are the attempt's; the handler's writes still commit once, with the completion."""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from typing import Any

import pytest
from jobapp import Ledger, TaskJob
from sqlalchemy import Engine, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sa_jobqueue import HandlerCall, InvalidArgumentError, JobContext, JobRepository, RetryPolicy, TaskRegistry, Worker
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker

jobs = JobRepository(TaskJob)
QUICK = RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0)
tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")


def _notes(engine: Engine) -> dict[int, str | None]:
    with Session(engine) as session:
        return {row.job_id: row.note for row in session.scalars(select(Ledger))}


def _statuses(engine: Engine) -> dict[int, str]:
    with Session(engine) as session:
        return {job.id: job.status for job in session.scalars(select(TaskJob))}


def _recording(log: list[str], name: str) -> Any:
    @contextmanager
    def middleware(call: HandlerCall) -> Iterator[None]:
        log.append(f"{name} enter {call.task} attempt {call.context.attempt}")
        try:
            yield
        except Exception as exc:
            log.append(f"{name} saw {exc}")
            raise
        log.append(f"{name} exit result={call.result}")
    return middleware


SET_TENANT = text("SELECT set_config('app.tenant', :name, true)")


def per_tenant(call: HandlerCall) -> Any:
    """Sets a context variable, and a setting of the job's own transaction (SET LOCAL):
    with an await on the AsyncSession around an async def handler."""
    return _per_tenant_async(call) if call.is_async else _per_tenant(call)


@contextmanager
def _per_tenant(call: HandlerCall) -> Iterator[None]:
    name = f"tenant-{call.context.id}"
    token = tenant.set(name)
    if call.session is not None:
        call.session.execute(SET_TENANT, {"name": name})
    try:
        yield
    finally:
        tenant.reset(token)


@asynccontextmanager
async def _per_tenant_async(call: HandlerCall) -> AsyncIterator[None]:
    name = f"tenant-{call.context.id}"
    token = tenant.set(name)
    if call.session is not None:
        await call.session.execute(SET_TENANT, {"name": name})
    try:
        yield
    finally:
        tenant.reset(token)


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_the_chain_runs_in_order_around_each_handler(engine: Engine, mode: str) -> None:
    log: list[str] = []
    registry = TaskRegistry(repository=jobs, middleware=[_recording(log, "outer")])
    registry.use(_recording(log, "inner"))

    @registry.task(retry=QUICK)
    def double(ctx: JobContext, session: Session, n: int) -> int:
        session.add(Ledger(job_id=ctx.id, note="written"))
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return 2 * n

    with Session(engine) as session, session.begin():
        job = double.enqueue(session, 21)
    Worker(engine, jobs, registry, mode=mode, listen=False, poll_interval=0.05).run(until_empty=True)
    assert log == [
        "outer enter double attempt 1", "inner enter double attempt 1",
        "inner saw first attempt fails", "outer saw first attempt fails",
        "outer enter double attempt 2", "inner enter double attempt 2",
        "inner exit result=42", "outer exit result=42",
    ]
    assert _notes(engine) == {job.id: "written"}  # once: the failed attempt's write rolled back


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_context_variable_and_a_transaction_setting_reach_the_handler(engine: Engine, mode: str) -> None:
    registry = TaskRegistry(repository=jobs, middleware=[per_tenant])

    @registry.task
    def note(ctx: JobContext, session: Session) -> None:
        setting = session.execute(text("SELECT current_setting('app.tenant', true)")).scalar_one()
        session.add(Ledger(job_id=ctx.id, note=f"{tenant.get()}/{setting}"))

    @registry.task
    def plain(n: int) -> None:  # no session: call.session is None, the variable still set
        assert tenant.get() != "none"

    with Session(engine) as session, session.begin():
        made = [note.enqueue(session) for _ in range(3)] + [plain.enqueue(session, 1)]
    Worker(engine, jobs, registry, mode=mode, listen=False, poll_interval=0.05).run(until_empty=True)
    assert _notes(engine) == {j.id: f"tenant-{j.id}/tenant-{j.id}" for j in made[:3]}
    assert _statuses(engine) == {}


def test_a_failing_middleware_fails_the_attempt_and_nothing_commits(engine: Engine) -> None:
    @contextmanager
    def refuse_after(call: HandlerCall) -> Iterator[None]:
        yield
        raise PermissionError(f"no quota left for {call.task}")

    registry = TaskRegistry(repository=jobs, middleware=[refuse_after])

    @registry.task(max_attempts=1)
    def write(ctx: JobContext, session: Session) -> None:
        session.add(Ledger(job_id=ctx.id, note="never"))

    with Session(engine) as session, session.begin():
        job = write.enqueue(session)
    result = Worker(engine, jobs, registry, listen=False, poll_interval=0.05).run(until_empty=True)
    assert result.dead == 1 and _notes(engine) == {}
    with Session(engine) as session:
        row = session.get(TaskJob, job.id)
        assert row is not None and "no quota left for write" in (row.last_error or "")


@pytest.mark.parametrize(("middleware", "says"), [
    pytest.param(lambda call: None, "returned NoneType", id="no-context-manager"),
    pytest.param(_per_tenant_async, "@contextmanager", id="async-around-a-sync-handler"),
])
def test_a_middleware_of_the_wrong_kind_is_a_clear_failure(engine: Engine, middleware: Any, says: str) -> None:
    registry = TaskRegistry(repository=jobs, middleware=[middleware])

    @registry.task(max_attempts=1)
    def noop() -> None:
        pass

    with Session(engine) as session, session.begin():
        job = noop.enqueue(session)
    Worker(engine, jobs, registry, listen=False, poll_interval=0.05).run(until_empty=True)
    with Session(engine) as session:
        row = session.get(TaskJob, job.id)
        assert row is not None and row.status == "dead" and says in (row.last_error or "")


def test_grouped_commits_run_the_chain_per_job(engine: Engine) -> None:
    log: list[str] = []
    registry = TaskRegistry(repository=jobs, middleware=[_recording(log, "m")])

    @registry.task(group_commit=True)
    def write(ctx: JobContext, session: Session) -> None:
        session.add(Ledger(job_id=ctx.id, note="g"))

    with Session(engine) as session, session.begin():
        made = jobs.enqueue_many(session, [write.spec() for _ in range(6)])
    Worker(engine, jobs, registry, listen=False, poll_interval=0.05, batch_size=6).run(until_empty=True)
    assert sorted(_notes(engine)) == sorted(j.id for j in made)
    assert sum(line.startswith("m exit") for line in log) == 6


def test_bad_middleware_is_refused() -> None:
    for value in ("timed", [5], None):
        with pytest.raises(InvalidArgumentError) as raised:
            TaskRegistry(middleware=value)  # type: ignore[arg-type]
        assert raised.value.parameter == "middleware"
    with pytest.raises(InvalidArgumentError):
        TaskRegistry().use(5)  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["lease", "transaction"])
async def test_the_asyncio_worker_runs_the_chain_around_async_and_sync_handlers(
    async_engine: AsyncEngine, engine: Engine, mode: str
) -> None:
    log: list[str] = []
    registry = TaskRegistry(repository=jobs, middleware=[_recording(log, "m"), per_tenant])

    @registry.task
    async def note(ctx: JobContext, session: AsyncSession) -> str:
        setting = (await session.execute(text("SELECT current_setting('app.tenant', true)"))).scalar_one()
        session.add(Ledger(job_id=ctx.id, note=f"{tenant.get()}/{setting}"))
        return "async"

    @registry.task
    def sync_note(ctx: JobContext, session: Session) -> str:
        setting = session.execute(text("SELECT current_setting('app.tenant', true)")).scalar_one()
        session.add(Ledger(job_id=ctx.id, note=f"{tenant.get()}/{setting}"))
        return "sync"

    with Session(engine) as session, session.begin():
        made = [note.enqueue(session), sync_note.enqueue(session)]
    await AsyncWorker(async_engine, AsyncJobRepository(TaskJob), registry, sync_bind=engine, mode=mode, listen=False,
                      poll_interval=0.05).run(until_empty=True)
    assert _notes(engine) == {j.id: f"tenant-{j.id}/tenant-{j.id}" for j in made}
    assert sorted(line for line in log if "exit" in line) == ["m exit result=async", "m exit result=sync"]
