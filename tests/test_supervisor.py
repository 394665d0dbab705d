"""``sa-jobqueue worker --processes N`` (sa_jobqueue/cli/supervisor.py): real
processes and real signals. The supervisor starts N worker processes,
restarts one killed with SIGKILL (logging why), forwards SIGTERM, and exits
0 once all have stopped; the restart backoff is unit-tested as plain values."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import cli_tasks
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session
from waiting import wait_for

from sa_jobqueue import JobRepository, JobSpec, list_workers, psycopg_url
from sa_jobqueue.cli.supervisor import Backoff
from sa_jobqueue.default import Job

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
repo = JobRepository(Job)


def test_the_backoff_doubles_while_a_process_dies_young_and_starts_over_after_a_long_life() -> None:
    backoff = Backoff(first=1.0, cap=30.0, healthy_after=60.0)
    failures = 0
    delays = []
    for _ in range(7):
        failures = backoff.failures(failures, lived=2.0)
        delays.append(backoff.delay(failures))
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.failures(failures, lived=60.0) == 1


class _Stderr:
    """The supervisor's stderr, read as it comes, in a thread of its own."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        assert proc.stderr is not None
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._lock:
                self.lines.append(line)

    def find(self, pattern: str) -> list[re.Match[str]]:
        with self._lock:
            return [m for line in self.lines if (m := re.search(pattern, line))]

    def text(self) -> str:
        with self._lock:
            return "".join(self.lines)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_worker_process_is_restarted_and_sigterm_stops_them_all(cli_url: str) -> None:
    engine: Engine = create_engine(psycopg_url(cli_url))
    env = os.environ | {"DATABASE_URL": cli_url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_jobqueue.cli", "worker", "cli_tasks:tasks", "--processes", "2",
         "--concurrency", "2", "--name", "sup"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stderr = _Stderr(proc)
    started = r"supervisor: started worker process (\d+) \((\d) of 2\)"
    try:
        wait_for(lambda: len(stderr.find(started)) == 2, 60, "two worker processes to start")
        first = [int(m.group(1)) for m in stderr.find(started)]
        victim = first[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(stderr.find(started)) == 3, 60, "the killed worker process to be replaced")
        [why] = stderr.find(rf"worker process {victim} \(\d of 2\) was killed by SIGKILL after \d+ s; "
                            r"restarting it in 1 s")
        assert why
        replacement = int(stderr.find(started)[2].group(1))
        assert replacement not in first and _alive(first[1])
        # The processes serve jobs: every one enqueued now completes, once.
        with Session(engine) as session, session.begin():
            repo.enqueue_many(session, [JobSpec("record", payload={"note": str(n)}) for n in range(20)])

        def done() -> int:
            with engine.connect() as conn:
                return int(conn.execute(select(func.count()).select_from(cli_tasks.Done)).scalar_one())

        wait_for(lambda: done() == 20, 60, "the 20 jobs to complete")
        # Each process is named after the name given and its slot, the replacement too.
        wait_for(lambda: {m.group(1) for m in stderr.find(r"worker (sup-[12]) serving")} == {"sup-1", "sup-2"},
                 60, "both worker processes to serve, named sup-1 and sup-2")
        # The "serving" line comes before a worker installs its signal handlers, and a SIGTERM
        # before them ends it by the signal, without its result line. Its first presence beat
        # comes after them: wait for both processes' beats before the stop.

        def beating() -> set[int]:
            with Session(engine) as session:
                return {w.pid for w in list_workers(session) if w.alive}

        wait_for(lambda: beating() >= {first[1], replacement}, 60,
                 "both worker processes to beat, their signal handlers installed")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        engine.dispose()
    assert proc.returncode == 0, stderr.text()
    for pid in (first[1], replacement):
        wait_for(lambda p=pid: not _alive(p), 30, f"worker process {pid} to exit")  # type: ignore[misc]
    assert stderr.find(r"supervisor: SIGTERM received, stopping the worker processes")
    assert proc.stdout is not None and len(proc.stdout.read().strip().splitlines()) == 2  # each one's result


def test_a_usage_error_in_the_worker_processes_is_not_restarted(cli_url: str) -> None:
    """A worker process that exits with a usage error (here: --concurrency 0,
    which only the worker checks) stops the supervisor, exit code 2."""
    env = os.environ | {"DATABASE_URL": cli_url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "sa_jobqueue.cli", "worker", "cli_tasks:tasks", "--processes", "2",
         "--concurrency", "0"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "exited with a usage error; not restarting it" in done.stderr
    assert "restarting it in" not in done.stderr


def test_the_supervisor_checks_the_import_path_before_starting_any_process(cli_url: str) -> None:
    env = os.environ | {"DATABASE_URL": cli_url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "sa_jobqueue.cli", "worker", "cli_tasks:nothing_here", "--processes", "3"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0
    assert "started worker process" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
