"""Concurrency and crashes with real processes and real signals.

Workers and claimers run as separate processes (tests/jobapp.py). Every wait
has a timeout; every process a test starts is ended by its PID.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from jobapp import Ledger, TaskJob, jobs
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from waiting import wait_for

from sa_jobqueue import JobSpec

pytestmark = pytest.mark.slow
MODES = ["lease", "transaction"]


def _results(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, int]]:
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"worker exited with {proc.returncode}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _count(sessions: sessionmaker[Session], model: type, *where: object) -> int:
    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


def test_concurrent_claimers_never_exceed_the_limit_nor_share_a_job(
    sessions: sessionmaker[Session], libpq_url: str, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop") for _ in range(2000)])
    limit = 7
    procs = [spawn("claim", libpq_url, "--limit", str(limit), "--rounds", "60") for _ in range(8)]
    batches: list[list[int]] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        batches.extend(json.loads(line) for line in out.splitlines())
    claimed = [job_id for batch in batches for job_id in batch]
    assert len(batches) == 8 * 60
    assert max(len(batch) for batch in batches) <= limit
    assert len(claimed) == len(set(claimed)), "a job was claimed twice"
    # 8 x 60 x 7 = 3360 slots for 2000 jobs: all were claimed, each once.
    assert len(claimed) == 2000
    assert _count(sessions, TaskJob, TaskJob.status == "running") == 2000


@pytest.mark.parametrize("mode", MODES)
def test_exactly_once_with_8_worker_processes(
    sessions: sessionmaker[Session], libpq_url: str, spawn: Callable[..., subprocess.Popen[str]], mode: str
) -> None:
    total = 5000
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("ledger") for _ in range(total)])
    procs = [
        spawn("work", libpq_url, "--mode", mode, "--concurrency", "2", "--until-empty")
        for _ in range(8)
    ]
    results = _results(procs, timeout=600)
    with sessions() as session:
        ledger = session.scalar(select(func.count()).select_from(Ledger))
        distinct = session.scalar(select(func.count(func.distinct(Ledger.job_id))))
        left = session.scalar(select(func.count()).select_from(TaskJob))
    assert (ledger, distinct, left) == (total, total, 0)
    # Any second run of a job would have failed on the ledger's unique key
    # (counted as retried) or completed twice.
    assert sum(r["completed"] for r in results) == total
    assert sum(r["retried"] + r["dead"] + r["lost"] for r in results) == 0


@pytest.mark.parametrize("mode", MODES)
def test_sigkill_mid_job_then_the_job_completes_exactly_once(
    sessions: sessionmaker[Session], libpq_url: str, spawn: Callable[..., subprocess.Popen[str]],
    tmp_path: Path, mode: str,
) -> None:
    marker = tmp_path / "started"
    with sessions.begin() as session:
        job = jobs.enqueue(session, "hang_first", {"marker": str(marker)})
        jobs.enqueue_many(session, [JobSpec("ledger") for _ in range(20)])
    victim = spawn("work", libpq_url, "--mode", mode, "--concurrency", "2", "--lease", "2")
    wait_for(marker.exists, 60, "the job to start")
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    if mode == "transaction":
        # The transaction died with the process: the job is pending again at
        # once, its attempt not counted.
        wait_for(lambda: _count(sessions, TaskJob, TaskJob.id == job.id, TaskJob.status == "pending") == 1,
                  30, "the job to be pending again")
    else:
        with sessions() as session:
            row = session.get(TaskJob, job.id)
            assert row is not None and row.status == "running" and row.attempts == 1
    rescuer = spawn("work", libpq_url, "--mode", mode, "--concurrency", "2", "--lease", "2")
    wait_for(lambda: _count(sessions, TaskJob) == 0, 60, "every job to finish")
    rescuer.send_signal(signal.SIGTERM)
    assert _results([rescuer], timeout=30)[0]["lost"] == 0
    with sessions() as session:
        notes = dict(session.execute(select(Ledger.job_id, Ledger.note)).all())
    assert len(notes) == 21
    assert notes[job.id] == ("attempt 2" if mode == "lease" else "attempt 1")


def test_a_job_that_kills_its_worker_every_time_ends_dead(
    sessions: sessionmaker[Session], libpq_url: str, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "kill_worker", max_attempts=2)
    deaths = 0
    deadline = time.monotonic() + 120

    def dead() -> bool:
        return _count(sessions, TaskJob, TaskJob.status == "dead") == 1

    while not dead():
        assert time.monotonic() < deadline, "the job never went dead"
        worker = spawn("work", libpq_url, "--mode", "lease", "--concurrency", "1", "--lease", "1")
        wait_for(lambda w=worker: w.poll() is not None or dead(), 60, "the worker to die or the job to go dead")
        if worker.poll() is None:
            # This worker reaped the job into dead and lives on: stop it.
            worker.send_signal(signal.SIGTERM)
            worker.communicate(timeout=30)
            assert worker.returncode == 0
        else:
            deaths += worker.returncode == -signal.SIGKILL
    assert deaths == 2
    with sessions() as session:
        row = session.get(TaskJob, job.id)
        assert row is not None and row.status == "dead" and row.attempts == 2
        assert "lease expired" in (row.last_error or "")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_claiming_finishes_the_running_job_and_exits_0(
    sessions: sessionmaker[Session], libpq_url: str, spawn: Callable[..., subprocess.Popen[str]],
    tmp_path: Path, sig: signal.Signals,
) -> None:
    marker = tmp_path / "started"
    with sessions.begin() as session:
        first = jobs.enqueue(session, "slow", {"seconds": 1.5, "marker": str(marker)}, priority=-1)
        jobs.enqueue_many(session, [JobSpec("slow", {"seconds": 1.5}) for _ in range(3)])
    worker = spawn("work", libpq_url, "--mode", "lease", "--concurrency", "1")
    wait_for(marker.exists, 60, "the first job to start")
    worker.send_signal(sig)
    [result] = _results([worker], timeout=30)
    assert result["completed"] == 1
    with sessions() as session:
        assert list(session.scalars(select(Ledger.job_id))) == [first.id]
    assert _count(sessions, TaskJob, TaskJob.status == "pending") == 3
    assert _count(sessions, TaskJob, TaskJob.status == "running") == 0
