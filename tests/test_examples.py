"""The examples run end to end, each as a subprocess on a fresh database of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 120  # seconds, for every subprocess


def _run(args: list[str], url: URL) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url.set(drivername="postgresql").render_as_string(hide_password=False)}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)


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
def test_flask_app(create_database: Callable[[], URL]) -> None:
    url = create_database()
    out = _run([sys.executable, str(EXAMPLES / "flask_app.py")], url)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("POST /signup -> 201"), out.stdout
    assert "welcome@example.com sends the welcome email to ada@example.com" in out.stdout
    assert "worker: completed 1, retried 0, dead 0, lost 0" in lines
    assert lines[-1] == "user 1 welcomed by: welcome@example.com; jobs left in the queue: 0"

    # The same app through the flask command: enqueue, stats, and a worker until empty.
    flask = [sys.executable, "-m", "flask", "--app", str(EXAMPLES / "flask_app.py"), "jobs"]
    out = _run([*flask, "enqueue", "send_welcome", "--payload", '{"user_id": 1}', "--queue", "signup"], url)
    assert out.returncode == 0, out.stdout + out.stderr
    out = _run([*flask, "stats"], url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert any(line.split()[:3] == ["signup", "pending", "1"] for line in out.stdout.splitlines()), out.stdout
    out = _run([*flask, "worker", "--queue", "signup", "--until-empty"], url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert '"completed": 1' in out.stdout and "sends the welcome email" in out.stdout
