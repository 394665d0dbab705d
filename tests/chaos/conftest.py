"""Fixtures of the fault suite (``pytest -m chaos``) and its report.

The suite runs on a PostgreSQL of its own (tests/pgserver.py), which it may
restart, never on ``DATABASE_URL``'s server. At the end of the session it
prints the reliability report: one row per scenario and mode.

``CHAOS_SEED`` makes the random choices (payloads, which worker to kill,
when) repeatable; ``CHAOS_JOBS`` changes the number of jobs per scenario.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import REPORT, Run, report_table
from pgserver import PgServer
from tcpproxy import TcpProxy

SEED = os.environ.get("CHAOS_SEED") or str(int(time.time()))


@pytest.fixture(scope="session")
def chaos_server() -> Iterator[PgServer]:
    """A throwaway PostgreSQL on a free loopback port, stopped at the end."""
    with PgServer() as server:
        yield server


@pytest.fixture
def make_run(chaos_server: PgServer, tmp_path: Path) -> Iterator[Callable[..., Run]]:
    """Factory of scenario runs; each is ended (processes, database) at teardown."""
    runs: list[Run] = []

    def make(scenario: str, mode: str, **options: Any) -> Run:
        run = Run(chaos_server, tmp_path / scenario, scenario, mode, seed=SEED, **options)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


@pytest.fixture
def proxy(chaos_server: PgServer) -> Iterator[TcpProxy]:
    """A TCP proxy in front of the suite's server."""
    with TcpProxy(("127.0.0.1", chaos_server.port)) as tcp:
        yield tcp


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not REPORT:
        return
    terminalreporter.section("reliability report")
    terminalreporter.write_line(
        f"CHAOS_SEED={SEED}; time to recover: the longest, over a run's faults, from the fault "
        "to the next commit (or, for a killed or frozen worker, until every job it held committed elsewhere)"
    )
    for line in report_table(REPORT):
        terminalreporter.write_line(line)
    notes = [(r, note) for r in REPORT for note in r.notes]
    if notes:
        terminalreporter.write_line("")
        for r, note in notes:
            terminalreporter.write_line(f"- {r.scenario} ({r.mode}): {note}")
