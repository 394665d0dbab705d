"""The examples run end to end, each as a subprocess on a fresh database of its own."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.engine import URL

from sa_jobqueue.default import Job

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FLASK_APP = EXAMPLES / "flask_app"
TIMEOUT = 120  # seconds, for every subprocess


def _env(url: URL) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": url.set(drivername="postgresql").render_as_string(hide_password=False)}


def _run(args: list[str], url: URL, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_env(url), capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.slow
def test_plain_script(create_database: Callable[[], URL]) -> None:
    out = _run([sys.executable, str(EXAMPLES / "plain_script.py")], create_database())
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("enqueued job 1 (send_welcome) for user 1"), out.stdout
    assert "sending the welcome email to ada@example.com" in out.stdout
    assert "worker: completed 1, retried 0, dead 0, lost 0" in lines
    assert lines[-1] == "user 1 welcomed: True; jobs left in the queue: 0"


@pytest.mark.slow
def test_demo_draws_no_progress_frames_into_a_pipe(create_database: Callable[[], URL]) -> None:
    """With stdout and stderr piped (a log), tqdm's bars are off: no carriage-return frames."""
    url = create_database()  # the demo creates (and drops) a database of its own on this server
    args = ["--jobs", "200", "--processes", "2", "--concurrency", "2", "--per-transaction", "100"]
    out = _run([sys.executable, str(EXAMPLES / "demo.py"), *args], url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exactly once   PASSED" in out.stdout, out.stdout
    assert "\r" not in out.stdout and "\r" not in out.stderr, (out.stdout, out.stderr)
    assert "job/s" not in out.stderr  # no bar, not even a final one


# -- examples/flask_app: the app of docs/flask.md ------------------------------


def _flask_doc_commands() -> list[list[str]]:
    """The ``flask --app app jobs …`` lines of docs/flask.md, as argument lists."""
    text = (ROOT / "docs" / "flask.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M) if "flask --app app jobs" in b]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_flask_app(create_database: Callable[[], URL]) -> None:
    """demo.py (create_app, a signup, a worker until empty), then every ``flask jobs`` line of the docs."""
    url = create_database()
    out = _run([sys.executable, "demo.py"], url, cwd=FLASK_APP)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("POST /signup -> 201"), out.stdout
    assert "welcome@example.com sends 'Welcome!' to ada@example.com" in out.stdout
    assert "worker: completed 1, retried 0, dead 0, lost 0" in lines
    assert lines[-1] == "user 1 welcomed: True; jobs left in the queue: 0"

    commands = _flask_doc_commands()
    assert commands[0][:4] == ["flask", "--app", "app", "jobs"]
    job_id: str | None = None
    ran = []
    for command in commands:
        if command[4] == "worker" and "--until-empty" not in command:
            continue  # runs until SIGTERM: worker.py is that case, below
        if "1234" in command:
            assert job_id is not None, "the docs show an id before the enqueue line"
            command = [job_id if arg == "1234" else arg for arg in command]
        out = _run([sys.executable, "-m", *command], url, cwd=FLASK_APP)
        assert out.returncode == 0, (command, out.stdout + out.stderr)
        if command[4] == "enqueue":
            job_id = out.stdout.strip()
        ran.append(command[4:6])
    assert ["jobs", "show"] in ran and ["cancel", job_id] in ran and ["health"] in ran

    out = _run([sys.executable, "-m", "flask", "--app", "app", "jobs", "jobs", "show", "abc"], url, cwd=FLASK_APP)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("Error: Invalid value for 'ID'"), out.stderr


@pytest.mark.slow
def test_flask_worker_script_until_sigterm(create_database: Callable[[], URL]) -> None:
    """docs/flask.md's worker.py serves the signup queue until SIGTERM, then exits 0."""
    url = create_database()
    setup = _run([sys.executable, "demo.py"], url, cwd=FLASK_APP)  # the tables and user 1
    assert setup.returncode == 0, setup.stdout + setup.stderr
    flask = [sys.executable, "-m", "flask", "--app", "app", "jobs"]
    out = _run([*flask, "enqueue", "send_welcome", "--payload", '{"user_id": 1}', "--queue", "signup"], url, FLASK_APP)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = int(out.stdout)

    engine = create_engine(url)
    proc = subprocess.Popen([sys.executable, "worker.py"], cwd=FLASK_APP, env=_env(url), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT
        left = 1
        while left and proc.poll() is None and time.monotonic() < deadline:
            with engine.connect() as conn:
                left = conn.execute(select(func.count()).select_from(Job).where(Job.id == job_id)).scalar_one()
            if left:
                time.sleep(0.1)
        assert left == 0, f"job {job_id} not completed (worker exit code {proc.poll()})"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        engine.dispose()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    assert "welcome@example.com sends 'Welcome!' to ada@example.com" in stdout
