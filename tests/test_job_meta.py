"""A job's meta (JobSpec.meta, enqueue's meta, configure(meta=...)): a JSON object written at enqueue by
every insert path (one INSERT, insertmanyvalues, COPY; sync and both async drivers), returned as stored;
and the enqueue hooks (sa_jobqueue.enqueue_hooks) that add to it in the caller's transaction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from jobapp import TaskJob
from sqlalchemy import Engine, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sa_jobqueue import JobRepository, JobSpec, TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository
from sa_jobqueue.bulk import COPY_THRESHOLD
from sa_jobqueue.enqueue_hooks import Enqueueing, add_enqueue_hook, enqueue_hooks, remove_enqueue_hook

jobs = JobRepository(TaskJob)
MANY = COPY_THRESHOLD + 4  # enough rows for COPY


def _stored(engine: Engine) -> dict[int, Any]:
    with Session(engine) as session:
        return {job_id: meta for job_id, meta in session.execute(select(TaskJob.id, TaskJob.meta))}


@pytest.fixture
def hook() -> Iterator[list[Enqueueing]]:
    """An enqueue hook that adds {"hook": n} and records what it saw; unregistered after the test."""
    seen: list[Enqueueing] = []

    @contextmanager
    def adds(enqueueing: Enqueueing) -> Iterator[None]:
        enqueueing.meta["hook"] = len(seen)
        enqueueing.meta["shared"] = "from the hook"
        seen.append(enqueueing)
        yield

    add_enqueue_hook(adds)
    add_enqueue_hook(adds)  # once only
    try:
        assert enqueue_hooks().count(adds) == 1
        yield seen
    finally:
        remove_enqueue_hook(adds)
    assert adds not in enqueue_hooks()


def test_every_insert_path_stores_meta_and_returns_it(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        one = jobs.enqueue(session, "noop", meta={"a": 1})
        keyed = jobs.enqueue(session, "noop", meta={"k": [1, 2]}, dedupe_key="k")
        few = jobs.enqueue_many(session, [JobSpec("noop", meta={"n": n}) for n in range(3)])
        copied = jobs.enqueue_many(session, [JobSpec("noop", meta={"n": n}) for n in range(MANY)])
        mixed = jobs.enqueue_many(session, [JobSpec("noop", meta={"n": n} if n % 2 else None) for n in range(MANY)])
        plain = jobs.enqueue(session, "noop")
    made = [one, keyed, *few, *copied, *mixed, plain]
    stored = _stored(engine)
    assert {job.id: job.meta for job in made} == stored  # the snapshots are what was stored
    assert stored[one.id] == {"a": 1} and stored[keyed.id] == {"k": [1, 2]}
    assert [stored[j.id] for j in copied] == [{"n": n} for n in range(MANY)]
    assert [stored[j.id] for j in mixed] == [{"n": n} if n % 2 else None for n in range(MANY)]
    assert stored[plain.id] is None  # no meta, no hook: NULL


@pytest.mark.anyio
async def test_the_async_repository_stores_meta_on_both_drivers(async_engine: AsyncEngine, engine: Engine) -> None:
    repository = AsyncJobRepository(TaskJob)
    async with AsyncSession(async_engine) as session, session.begin():
        one = await repository.enqueue(session, "noop", meta={"a": "b"})
        copied = await repository.enqueue_many(session, [JobSpec("noop", meta={"n": n}) for n in range(MANY)])
    stored = _stored(engine)
    assert stored[one.id] == {"a": "b"}
    assert [stored[j.id] for j in copied] == [{"n": n} for n in range(MANY)] == [j.meta for j in copied]


def test_configure_gives_the_meta_of_a_task_job(engine: Engine) -> None:
    registry = TaskRegistry(repository=jobs)

    @registry.task
    def tagged(n: int) -> None:
        pass

    configured = tagged.configure(meta={"origin": "import"})
    with Session(engine) as session, session.begin():
        first = configured.enqueue(session, 1)
        second = configured.configure(meta={"origin": "api"}).enqueue(session, 2)  # a given meta replaces
        third = jobs.enqueue_many(session, [configured.spec(3)])[0]
        fourth = tagged.enqueue(session, 4)
    stored = _stored(engine)
    assert [stored[j.id] for j in (first, second, third, fourth)] == [
        {"origin": "import"}, {"origin": "api"}, {"origin": "import"}, None]


def test_a_hook_adds_to_every_enqueue_and_sees_the_jobs(engine: Engine, hook: list[Enqueueing]) -> None:
    with Session(engine) as session, session.begin():
        one = jobs.enqueue(session, "noop", queue="mail")
        given = jobs.enqueue(session, "noop", meta={"shared": "from the caller", "own": 1})
        copied = jobs.enqueue_many(session, [JobSpec("other", queue="q2") for _ in range(MANY)])
        assert jobs.enqueue_many(session, []) == [] and len(hook) == 3  # nothing written, no hook called
    stored = _stored(engine)
    assert stored[one.id] == {"hook": 0, "shared": "from the hook"}
    assert stored[given.id] == {"hook": 1, "shared": "from the caller", "own": 1}  # the caller's keys win
    assert {stored[j.id]["hook"] for j in copied} == {2} and copied[0].meta == stored[copied[0].id]
    assert hook[0].table == "task_jobs" and hook[0].queues == ["mail"] and hook[0].tasks == ["noop"]
    assert [j.id for j in hook[0].jobs] == [one.id]
    assert [j.id for j in hook[2].jobs] == [j.id for j in copied] and hook[2].queues == ["q2"] * MANY


def test_a_rolled_back_enqueue_leaves_nothing_and_a_failing_hook_writes_nothing(engine: Engine) -> None:
    @contextmanager
    def refuses(enqueueing: Enqueueing) -> Iterator[None]:
        raise PermissionError("no enqueue today")
        yield

    with Session(engine) as session:
        jobs.enqueue(session, "noop", meta={"a": 1})
        session.rollback()
    add_enqueue_hook(refuses)
    try:
        with Session(engine) as session, pytest.raises(PermissionError):
            jobs.enqueue(session, "noop")
    finally:
        remove_enqueue_hook(refuses)
    assert _stored(engine) == {}


def test_a_hook_that_swallows_the_enqueues_error_is_an_error(engine: Engine) -> None:
    @contextmanager
    def swallows(enqueueing: Enqueueing) -> Iterator[None]:
        try:
            yield
        except Exception:
            pass

    add_enqueue_hook(swallows)
    try:
        with Session(engine) as session, pytest.raises(RuntimeError, match="swallowed"):
            session.execute(text("SET TRANSACTION READ ONLY"))  # the INSERT fails
            jobs.enqueue(session, "noop")
    finally:
        remove_enqueue_hook(swallows)
    assert _stored(engine) == {}
