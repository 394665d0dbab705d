"""Graceful stop, in real worker processes with real signals (docs/concepts.md,
"Stopping a worker"): SIGTERM hands back the jobs claimed but not started at
once, waits for the running ones up to the shutdown timeout, then the worker
returns; a second signal stops it at once."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from jobapp import TaskJob, jobs
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from waiting import wait_for

from sa_jobqueue import JobSpec

pytestmark = pytest.mark.slow


def _rows(sessions: sessionmaker[Session]) -> dict[int, tuple[str, int]]:
    with sessions() as session:
        return {r.id: (r.status, r.attempts) for r in session.execute(select(TaskJob.id, TaskJob.status,
                                                                             TaskJob.attempts))}


def _started(marker: Path) -> list[int]:
    return [int(line) for line in marker.read_text().split()] if marker.exists() else []


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_sigterm_hands_back_the_claimed_backlog_and_lets_the_running_job_finish(
    sessions: sessionmaker[Session], libpq_url: str, spawn: Callable[..., subprocess.Popen[str]],
    tmp_path: Path, mode: str,
) -> None:
    marker = tmp_path / "started"
    with sessions.begin() as session:
        ids = [j.id for j in jobs.enqueue_many(
            session, [JobSpec("slow", {"marker": str(marker), "seconds": 2}) for _ in range(20)])]
    # One thread, batches of 10: the worker holds a backlog of claimed jobs
    # behind the one running handler.
    worker = spawn("work", libpq_url, "--mode", mode, "--concurrency", "1", "--batch-size", "10",
                   "--shutdown-timeout", "60")
    wait_for(marker.exists, 60, "the first job to start")
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0
    result = json.loads(out.strip().splitlines()[-1])
    rows = _rows(sessions)
    assert result["completed"] == 1 and len(rows) == 19  # the running job finished and committed
    assert result["handed_back"] >= 9  # the rest of its batch at least
    # Every job left is pending, its attempts not counted: nothing ran but the one.
    assert all(rows[i] == ("pending", 0) for i in rows), rows
    assert set(rows) < set(ids)


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_sigterm_does_not_wait_past_the_shutdown_timeout_for_a_hung_job(
    sessions: sessionmaker[Session], libpq_url: str, spawn: Callable[..., subprocess.Popen[str]],
    tmp_path: Path, mode: str,
) -> None:
    marker = tmp_path / "started"
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("hang", {"marker": str(marker)}) for _ in range(20)])
    worker = spawn("work", libpq_url, "--mode", mode, "--concurrency", "1", "--batch-size", "10",
                   "--shutdown-timeout", "1", "--lease", "60")
    wait_for(lambda: len(_started(marker)) == 1, 60, "the first job to start")
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=60)  # returns: the hung handler does not hold the stop
    assert worker.returncode == 0
    hung = _started(marker)[0]
    if mode == "lease":
        rows = _rows(sessions)
        assert rows[hung] == ("running", 1)  # left to its lease
        # The rest of the backlog was handed back: pending, the claim's attempt not counted.
        assert all(rows[i] == ("pending", 0) for i in rows if i != hung), rows
        assert json.loads(out.strip().splitlines()[-1])["handed_back"] >= 9
    else:
        # The batch's transaction ends with the process: every row pending as before.
        wait_for(lambda: all(v == ("pending", 0) for v in _rows(sessions).values()), 60,
                  "the batch's transaction to roll back")
    assert _started(marker) == [hung]  # no other handler ran


def test_a_second_sigterm_stops_at_once(
    sessions: sessionmaker[Session], libpq_url: str, spawn: Callable[..., subprocess.Popen[str]], tmp_path: Path,
) -> None:
    marker = tmp_path / "started"
    with sessions.begin() as session:
        jobs.enqueue(session, "hang", {"marker": str(marker)})
    worker = spawn("work", libpq_url, "--concurrency", "1", "--shutdown-timeout", "3600")
    wait_for(lambda: len(_started(marker)) == 1, 60, "the job to start")
    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received, stopping" in _log(tmp_path), 30, "the first signal to be logged")
    assert worker.poll() is None  # waiting for the running job, up to an hour
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=60)
    assert worker.returncode == 0
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob).where(TaskJob.status == "running")) == 1


def _log(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in tmp_path.glob("proc-*.log"))


# A signal that lands while the main thread holds the lock of the worker's
# wake-up event (inside its wait(), clear() or set()): a handler that sets
# the event there would wait on that lock forever. Provoked deterministically
# by raising the signal inside ``with wake._cond``.
_SIGNAL_UNDER_THE_LOCK = """
import os, signal, sys, threading
from sa_jobqueue.worker.shutdown import Shutdown

stopping, wake = threading.Event(), threading.Event()
shutdown = Shutdown("w", stopping, wake)
restore = shutdown.install()
with wake._cond:  # what Event.wait() holds between its checks
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # bytecodes for the handler to run at, the lock still held
        pass
print("stopping" if stopping.wait(30) else "not stopping", flush=True)
restore()
print("restored" if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else "not restored", flush=True)
"""


def test_a_signal_while_the_loop_holds_its_wake_up_lock_still_stops_the_worker() -> None:
    import sys

    proc = subprocess.run([sys.executable, "-c", _SIGNAL_UNDER_THE_LOCK], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["stopping", "restored"], proc.stdout + proc.stderr
