"""The queue verbs on an AsyncSession (sa_jobqueue.aio), on both async
drivers: the same names, arguments, checks, errors and outcomes as on a
Session, enqueue committing or vanishing with the caller's writes, COPY
for plain bulk rows, and bad input refused with nothing written."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from jobapp import EmailJob, Ledger, TaskJob, User
from sqlalchemy import Engine, event, func, select, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session
from waiting import wait_for

from sa_jobqueue import Dedupe, InvalidArgumentError, JobLostError, JobRepository, JobSpec
from sa_jobqueue.aio import AsyncJobRepository
from sa_jobqueue.bulk import COPY_THRESHOLD
from sa_jobqueue.default import Job
from sa_jobqueue.urls import psycopg_url

pytestmark = pytest.mark.anyio

tasks = AsyncJobRepository(TaskJob)
emails = AsyncJobRepository(EmailJob)


@pytest.fixture
def sessions(async_engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(async_engine, expire_on_commit=False)


def _count(engine: Engine, model: Any) -> int:
    with Session(engine) as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


def _columns(job: Any) -> dict[str, Any]:
    return {attr.key: getattr(job, attr.key) for attr in sa_inspect(type(job)).column_attrs}


# -- the same verbs ------------------------------------------------------------


def _verbs(cls: type) -> dict[str, Any]:
    return {name: member for name, member in vars(cls).items() if not name.startswith("_") and callable(member)}


def test_every_verb_has_an_awaitable_twin_with_the_same_parameters() -> None:
    sync, aio = _verbs(JobRepository), _verbs(AsyncJobRepository)
    assert set(sync) == set(aio)
    for name, verb in sync.items():
        twin = aio[name]
        assert inspect.iscoroutinefunction(twin), name
        mine = [(p.name, p.kind, p.default) for p in inspect.signature(verb).parameters.values()]
        theirs = [(p.name, p.kind, p.default) for p in inspect.signature(twin).parameters.values()]
        assert mine == theirs, name


# -- enqueue in the caller's transaction -------------------------------------------


async def test_an_enqueue_commits_with_the_callers_writes(
    sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    async with sessions() as session, session.begin():
        session.add(User(id=1, name="ada"))
        job = await tasks.enqueue(session, "send_welcome", {"user_id": 1}, queue="signup", priority=3)
    assert isinstance(job, TaskJob) and job.id and job.status == "pending" and job.payload == {"user_id": 1}
    with Session(engine) as session:
        stored = session.get(TaskJob, job.id)
        assert stored is not None and _columns(stored) == _columns(job)
        assert session.get(User, 1) is not None


async def test_an_enqueue_vanishes_with_the_callers_rollback(
    sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    async with sessions() as session:
        async with session.begin():
            session.add(User(id=2, name="bob"))
            await tasks.enqueue(session, "send_welcome", {"user_id": 2})
            await session.rollback()
    assert _count(engine, TaskJob) == 0 and _count(engine, User) == 0


async def test_a_dedupe_key_returns_the_live_job(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as session, session.begin():
        first = await tasks.enqueue(session, "report", {"first": True}, dedupe_key="daily")
        again = await tasks.enqueue(session, "report", {"other": True}, dedupe_key="daily")
    assert again.id == first.id and again.payload == {"first": True}


async def test_enqueue_many_report_replaces_and_reports(sessions: async_sessionmaker[AsyncSession]) -> None:
    replace = Dedupe("daily", on_conflict="replace")
    async with sessions() as session, session.begin():
        first = await tasks.enqueue(session, "report", {"n": 1}, dedupe_key=replace)
        outcomes = await tasks.enqueue_many_report(session, [JobSpec("report", {"n": 2}, dedupe_key=replace)])
    assert [(o.job.id, o.outcome, o.job.payload) for o in outcomes] == [(first.id, "replaced", {"n": 2})]


async def test_an_enqueue_notifies_the_tables_channel_at_commit(
    sessions: async_sessionmaker[AsyncSession], libpq_url: str
) -> None:
    with psycopg.connect(libpq_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{tasks.channel}"')
        async with sessions() as session, session.begin():
            await tasks.enqueue(session, "noop", queue="wake")
        got: list[str] = []

        def heard() -> bool:
            got.extend(n.payload for n in listener.notifies(timeout=0.2, stop_after=1))
            return bool(got)

        wait_for(heard, 30, "the enqueue's NOTIFY")
    assert got == ["wake"]


# -- enqueue_many: COPY on both drivers ------------------------------------------------


def _bulk_specs(*, meta: bool = False) -> list[JobSpec]:
    """Enough specs for COPY, with a run_at, a delay, priorities, queues, a tuple, meta when asked."""
    at = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    return [JobSpec("noop", {"i": i, "t": (1, "a")}, queue=f"q{i % 2}", priority=i % 3, meta={"m": i} if meta else None,
                    run_at=at if i % 4 == 0 else None, delay=timedelta(seconds=5) if i % 4 == 1 else None)
            for i in range(COPY_THRESHOLD + 4)]


@contextmanager
def _recorded(async_engine: AsyncEngine) -> Iterator[list[str]]:
    """The statements the engine sends through a cursor inside the block (not COPY's data)."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        sent.append(statement)

    event.listen(async_engine.sync_engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(async_engine.sync_engine, "before_cursor_execute", record)


async def test_plain_bulk_rows_go_through_copy_and_come_back_as_stored(
    sessions: async_sessionmaker[AsyncSession], async_engine: AsyncEngine, engine: Engine
) -> None:
    specs = _bulk_specs()
    with _recorded(async_engine) as sent:
        async with sessions() as session, session.begin():
            written = await tasks.enqueue_many(session, specs)
    assert not [s for s in sent if s.lstrip().upper().startswith("INSERT")], "COPY should stand in for the INSERT"
    assert [j.payload for j in written] == [{"i": i, "t": [1, "a"]} for i in range(len(specs))]
    with Session(engine) as session:
        stored = {j.id: j for j in session.scalars(select(TaskJob))}
    assert len(stored) == len(specs)
    for job in written:
        assert _columns(job) == _columns(stored[job.id])


async def test_enqueue_many_fast_copies_and_counts(
    sessions: async_sessionmaker[AsyncSession], async_engine: AsyncEngine, engine: Engine
) -> None:
    """The stored rows equal enqueue_many's (the id aside), through COPY alone, on both drivers."""
    specs = _bulk_specs(meta=True)
    with _recorded(async_engine) as sent:
        async with sessions() as session, session.begin():
            assert await tasks.enqueue_many_fast(session, specs) == len(specs)
            assert await tasks.enqueue_many_fast(session, [JobSpec("noop", dedupe_key="k")] * 3) == 1
            await tasks.enqueue_many(session, specs)
    assert not [s for s in sent[:2] if s.lstrip().upper().startswith("INSERT")], "COPY should stand in for the INSERT"
    with Session(engine) as session:
        rows = [_columns(job) for job in session.scalars(select(TaskJob).where(TaskJob.dedupe_key.is_(None))
                                                         .order_by(TaskJob.id))]
    assert [row["payload"] for row in rows[:len(specs)]] == [{"i": i, "t": [1, "a"]} for i in range(len(specs))]
    for fast, many in zip(rows[:len(specs)], rows[len(specs):], strict=True):
        assert {k: v for k, v in fast.items() if k != "id"} == {k: v for k, v in many.items() if k != "id"}


async def test_enqueue_many_fast_refuses_a_bad_spec_mid_copy_and_writes_nothing(
    sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    """The spec is refused while the COPY streams, on both drivers: the SAVEPOINT rolls the rows
    sent before it back, and the transaction goes on."""
    specs = [JobSpec("noop", {"i": i}) for i in range(5_000)] + [JobSpec("noop", {"bad": {1, 2}})]
    async with sessions() as session, session.begin():
        await tasks.enqueue(session, "noop", {"before": True})
        with pytest.raises(InvalidArgumentError, match="payload"):
            await tasks.enqueue_many_fast(session, specs)
        await tasks.enqueue(session, "noop", {"after": True})
    with Session(engine) as session:
        assert [job.payload for job in session.scalars(select(TaskJob).order_by(TaskJob.id))] == [
            {"before": True}, {"after": True}]


async def test_rows_with_columns_of_the_apps_own_take_the_insert(sessions: async_sessionmaker[AsyncSession]) -> None:
    specs = [JobSpec("mail", {"i": i}, extra={"tenant_id": i}) for i in range(COPY_THRESHOLD + 1)]
    async with sessions() as session, session.begin():
        written = await emails.enqueue_many(session, specs)
    assert [j.tenant_id for j in written] == list(range(len(specs)))


# -- claim and the fenced verbs ---------------------------------------------------------


async def test_the_lifecycle_of_a_job(sessions: async_sessionmaker[AsyncSession], engine: Engine) -> None:
    async with sessions() as session, session.begin():
        ids = [(await tasks.enqueue(session, "noop", {"n": n}, queue="life")).id for n in range(4)]
    async with sessions() as session, session.begin():
        claimed = await tasks.claim(session, queues="life", limit=4, worker="w1", lease=timedelta(seconds=30))
    assert [j.id for j in claimed] == ids and all(j.status == "running" and j.attempts == 1 for j in claimed)
    done, failed, handed, cancelled = claimed
    async with sessions() as session, session.begin():
        assert await tasks.heartbeat(session, claimed) == set(ids)
        report = await tasks.extend_leases(session, claimed, lease=timedelta(minutes=1))
        assert report.owned == set(ids) and report.cancel_requested == set()
        await tasks.complete(session, done)
        assert await tasks.fail(session, failed, "boom", discard=True) == "dead"
        assert await tasks.hand_back(session, [handed]) == {handed.id}
        await tasks.mark_cancelled(session, cancelled)
    async with sessions() as session, session.begin():
        with pytest.raises(JobLostError):
            await tasks.complete(session, done)  # fenced: no longer owned
        assert await tasks.complete_many(session, [failed]) == set()
        assert await tasks.retry(session, failed.id) is True
        assert await tasks.cancel(session, handed.id) is True
        stats = {(s.queue, s.status): s.count for s in await tasks.stats(session)}
    assert stats == {("life", "pending"): 1, ("life", "cancelled"): 2}
    async with sessions() as session, session.begin():
        assert await tasks.purge(session, statuses=["cancelled"]) == 2
    assert _count(engine, TaskJob) == 1


async def test_an_expired_lease_is_reaped(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as session, session.begin():
        await tasks.enqueue(session, "noop", queue="reap")
        [job] = await tasks.claim(session, queues="reap", lease=timedelta(seconds=1))
        await session.execute(text("UPDATE task_jobs SET lease_expires_at = now() - interval '1 second'"))
    async with sessions() as session, session.begin():
        result = await tasks.reap(session)
        assert (result.requeued, result.dead, result.cancelled) == (1, 0, 0)
        assert await tasks.complete_many(session, [job]) == set()


async def test_a_handlers_writes_and_the_fenced_completion_commit_together(
    sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    async with sessions() as session, session.begin():
        await tasks.enqueue(session, "ledger", queue="together")
    async with sessions() as session, session.begin():
        [job] = await tasks.claim(session, queues="together")
    async with sessions() as session, session.begin():
        session.add(Ledger(job_id=job.id, note="written by the handler"))
        await tasks.complete(session, job)
    assert _count(engine, Ledger) == 1 and _count(engine, TaskJob) == 0


# -- bad input ----------------------------------------------------------------------------


BAD_CALLS: list[tuple[str, Callable[[AsyncSession], Any]]] = [
    ("task", lambda s: tasks.enqueue(s, "")),
    ("payload", lambda s: tasks.enqueue(s, "noop", {"x": object()})),
    ("run_at", lambda s: tasks.enqueue(s, "noop", run_at=datetime(2030, 1, 1))),
    ("jobs", lambda s: tasks.enqueue_many(s, [JobSpec("noop"), "not a spec"])),  # type: ignore[list-item]
    ("limit", lambda s: tasks.claim(s, limit=0)),
    ("lease", lambda s: tasks.claim(s, lease=timedelta(0))),
    ("job_id", lambda s: tasks.cancel(s, "7")),  # type: ignore[arg-type]
    ("older_than", lambda s: tasks.purge(s, older_than=timedelta(seconds=-1))),
]


@pytest.mark.parametrize(("parameter", "call"), BAD_CALLS, ids=[p for p, _ in BAD_CALLS])
async def test_bad_input_names_the_parameter_and_writes_nothing(
    parameter: str, call: Callable[[AsyncSession], Any], sessions: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    async with sessions() as session, session.begin():
        await tasks.enqueue(session, "noop", queue="kept")
    async with sessions() as session, session.begin():
        with pytest.raises(InvalidArgumentError) as raised:
            await call(session)
    assert raised.value.parameter == parameter
    with Session(engine) as session:
        assert [(j.queue, j.status) for j in session.scalars(select(TaskJob))] == [("kept", "pending")]


async def test_a_sync_session_is_refused_by_name(engine: Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(InvalidArgumentError, match="AsyncSession, got Session .*JobRepository") as raised:
            await tasks.enqueue(session, "noop")  # type: ignore[arg-type]
    assert raised.value.parameter == "session"


async def test_the_sync_verbs_point_an_async_session_to_the_async_repository(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as session:
        with pytest.raises(InvalidArgumentError, match="AsyncJobRepository") as raised:
            JobRepository(TaskJob).enqueue(session, "noop")  # type: ignore[arg-type]
    assert raised.value.parameter == "session"



# -- docs/asyncio.md -------------------------------------------------------------------------


async def test_the_pages_example_enqueues_in_the_callers_transaction(
    default_table: tuple[str, Engine], async_driver: str
) -> None:
    from test_docs import DOCS, python_blocks, section

    (code,) = python_blocks(section(DOCS / "asyncio.md", "## Enqueue in the request's transaction"))
    shown = '"postgresql+asyncpg://app@db.internal/app"'
    assert code.count(shown) == 1
    libpq, engine = default_table
    url = psycopg_url(libpq).set(drivername=f"postgresql+{async_driver}")
    namespace: dict[str, Any] = {}
    exec(compile(code.replace(shown, repr(url.render_as_string(hide_password=False))), "docs/asyncio.md", "exec"),
         namespace)
    try:
        job_id = await namespace["sign_up"]("ada@example.com")
    finally:
        await namespace["engine"].dispose()
    with Session(engine) as session:
        stored = session.get(Job, job_id)
        assert stored is not None and (stored.task, stored.queue, stored.payload) == (
            "send_welcome", "signup", {"email": "ada@example.com"})


# -- typing: a user's mypy run sees the awaitables ------------------------------------------

TYPED_USE = '''
from sqlalchemy.ext.asyncio import AsyncSession

from sa_jobqueue.aio import AsyncJobRepository
from sa_jobqueue.default import Job

jobs = AsyncJobRepository(Job)


async def fine(session: AsyncSession) -> None:
    job: Job = await jobs.enqueue(session, "noop", {"n": 1}, queue="q")
    claimed: list[Job] = await jobs.claim(session, queues=["q"], limit=5)
    owned: set[int] = await jobs.heartbeat(session, claimed)
    status: str = await jobs.fail(session, job, "boom")
    print(job, owned, status)


async def wrong(session: AsyncSession) -> None:
    forgot: Job = jobs.enqueue(session, "noop")  # line 19: a coroutine, not a Job
    count: int = await jobs.claim(session)  # line 20: a list of jobs
    await jobs.enqueue(session, "noop", priority="high")  # line 21: priority is an int
'''


def test_mypy_sees_the_awaitables_and_the_models_type(tmp_path: Any) -> None:
    import subprocess
    import sys

    source = tmp_path / "use.py"
    source.write_text(TYPED_USE)
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(source)],
                         capture_output=True, text=True, timeout=300)
    errors = sorted({int(line.split(":")[1]) for line in out.stdout.splitlines() if ": error:" in line})
    assert errors == [19, 20, 21], out.stdout
