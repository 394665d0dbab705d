"""sa_jobqueue.aio.testing: the testing helpers on an AsyncSession, committing
nothing; and docs/testing.md's asyncio conftest and test, run as a pytest
run of their own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobapp import Ledger, TaskJob, User, tasks
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from test_docs import DOCS, python_blocks, section

from sa_jobqueue import InvalidArgumentError, JobRepository, TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository
from sa_jobqueue.aio.testing import enqueued, run_enqueued, transactional_session

pytestmark = pytest.mark.anyio

jobs = AsyncJobRepository(TaskJob)


def _committed(engine: Engine) -> tuple[int, int, int]:
    with engine.connect() as conn:
        return tuple(int(conn.scalar(select(func.count()).select_from(m)) or 0)  # type: ignore[return-value]
                     for m in (TaskJob, Ledger, User))


async def test_enqueue_run_and_roll_back(async_engine: AsyncEngine, engine: Engine) -> None:
    async with transactional_session(async_engine) as session:
        async with session.begin():  # the application's code commits: a SAVEPOINT only
            session.add(User(id=7, name="ada"))
            await jobs.enqueue(session, "ledger", {"note": "from the test"})
        (job,) = await enqueued(session, jobs)
        assert job.task == "ledger" and job.status == "pending"
        assert _committed(engine) == (0, 0, 0)
        result = await run_enqueued(session, jobs, tasks)
        assert result.tasks == ["ledger"] and [j.id for j in result.completed] == [job.id]
        assert await session.scalar(select(func.count()).select_from(Ledger)) == 1
        assert await enqueued(session, jobs) == []
    assert _committed(engine) == (0, 0, 0)


async def test_a_failing_handler_raises_and_its_writes_roll_back(async_engine: AsyncEngine) -> None:
    async with transactional_session(async_engine) as session:
        await jobs.enqueue(session, "always_fails")
        with pytest.raises(ValueError, match="always fails"):
            await run_enqueued(session, [jobs], tasks)
        (job,) = await enqueued(session, jobs)
        assert job.attempts == 1 and job.last_error is not None and "always fails" in job.last_error
        assert await session.scalar(select(func.count()).select_from(Ledger)) == 0  # rolled back


async def test_async_handlers_run_inline_with_the_async_session_in_their_savepoint(
    async_engine: AsyncEngine, engine: Engine
) -> None:
    registry = TaskRegistry()

    @registry.task
    async def welcome(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="async"))
        await session.flush()
        await jobs.enqueue(session, "follow_up")

    @registry.task
    async def follow_up(job: TaskJob) -> None:
        await asyncio.sleep(0)

    @registry.task(max_attempts=1)
    async def fails(job: TaskJob, session: AsyncSession) -> None:
        session.add(Ledger(job_id=job.id, note="never"))
        await session.flush()
        raise ValueError("async handler failed")

    async with transactional_session(async_engine) as session:
        (first,) = [await jobs.enqueue(session, "welcome")]
        result = await run_enqueued(session, jobs, registry)
        assert result.tasks == ["welcome", "follow_up"] and result.rounds == 2
        assert (await session.execute(select(Ledger.job_id, Ledger.note))).all() == [(first.id, "async")]
        failing = await jobs.enqueue(session, "fails")
        with pytest.raises(ValueError, match="async handler failed"):
            await run_enqueued(session, jobs, registry)
        assert await session.scalar(select(func.count()).select_from(Ledger)) == 1  # its SAVEPOINT rolled back
        (dead,) = await enqueued(session, jobs, status="dead")
        assert dead.id == failing.id and dead.last_error is not None and "async handler failed" in dead.last_error
    assert _committed(engine) == (0, 0, 0)


async def test_bad_arguments_name_the_parameter(async_engine: AsyncEngine) -> None:
    async with transactional_session(async_engine) as session:
        with pytest.raises(InvalidArgumentError) as raised:
            await enqueued(session, JobRepository(TaskJob))  # type: ignore[arg-type]
        assert raised.value.parameter == "repository"
        with pytest.raises(InvalidArgumentError) as raised:
            await run_enqueued(session, "jobs", tasks)  # type: ignore[arg-type]
        assert raised.value.parameter == "repositories"
        with pytest.raises(InvalidArgumentError) as raised:
            await enqueued(session, jobs, status="nope")
        assert raised.value.parameter == "status"
    with pytest.raises(InvalidArgumentError) as raised:
        async with transactional_session(object()):  # type: ignore[arg-type]
            pass
    assert raised.value.parameter == "bind"


def test_the_pages_conftest_and_test_pass_as_a_pytest_run_of_their_own(
    tmp_path: Path, create_database: Any
) -> None:
    text = section(DOCS / "testing.md", "## asyncio applications")
    for block in python_blocks(text):
        first, _, body = block.partition("\n")
        assert first.startswith("# "), first
        (tmp_path / first[2:].strip()).write_text(body)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conftest.py", "test_signup.py"]
    url = create_database().set(drivername="postgresql").render_as_string(hide_password=False)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "DATABASE_URL": url}, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout, out.stdout
