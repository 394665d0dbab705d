"""sa_jobqueue.aio.testing: the testing helpers on an AsyncSession, committing
nothing; and docs/testing.md's asyncio conftest and test, run as a pytest
run of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from jobapp import Ledger, TaskJob, User, tasks
from sqlalchemy import Engine, func, select
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from test_docs import DOCS, python_blocks, section

from sa_jobqueue import InvalidArgumentError, JobRepository
from sa_jobqueue.aio import AsyncJobRepository
from sa_jobqueue.aio.testing import enqueued, run_enqueued, transactional_session

pytestmark = pytest.mark.anyio

jobs = AsyncJobRepository(TaskJob)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def async_engine(db_url: URL, engine: Engine) -> AsyncIterator[AsyncEngine]:
    """psycopg's async driver on the shared test schema (``engine``: its tables are emptied after)."""
    made = create_async_engine(db_url)
    try:
        yield made
    finally:
        await made.dispose()


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
