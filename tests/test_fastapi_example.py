"""examples/fastapi_app, the app of docs/fastapi.md, through a real uvicorn
server on loopback: a signup commits its user and its job together or
neither, and the worker process runs the job exactly once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import URL
from test_docs import files_shown
from waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "fastapi_app"
TIMEOUT = 120  # seconds, for every subprocess and wait

def _env(url: URL) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": url.set(drivername="postgresql").render_as_string(hide_password=False)}


def _call(method: str, address: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{address}{path}", method=method, data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def server(create_database: Callable[[], URL], request: pytest.FixtureRequest) -> Iterator[tuple[str, URL]]:
    """uvicorn serving the example app on a loopback socket this test bound
    (handed over by descriptor, so no other process can take the port); with
    an indirect parameter "worker in app", the app runs its worker in its lifespan."""
    url = create_database()
    env = _env(url) | ({"WORKER_IN_APP": "1"} if getattr(request, "param", None) == "worker in app" else {})
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{listening.getsockname()[1]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app.main:app", "--fd", str(listening.fileno()), "--log-level", "warning"],
        cwd=APP, env=env, pass_fds=[listening.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    listening.close()  # uvicorn holds its own copy

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"uvicorn exited with {proc.returncode}: {proc.communicate()[1]}")
        try:
            return _call("GET", address, "/users/0")[0] == 404  # served, and the database answered
        except OSError:
            return False

    try:
        wait_for(up, TIMEOUT, "the app to serve")
        yield address, url
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)


@pytest.mark.slow
def test_a_signup_commits_its_job_and_the_worker_runs_it_once(server: tuple[str, URL]) -> None:
    address, url = server
    status, created = _call("POST", address, "/signup", {"email": "ada@example.com"})
    assert status == 201, created
    status, again = _call("POST", address, "/signup", {"email": "ada@example.com"})
    assert status == 409, again  # the duplicate user failed, so its job was never committed

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            jobs = conn.execute(text("SELECT id, task, queue, payload FROM email_jobs")).all()
        assert [tuple(j) for j in jobs] == [(created["job_id"], "send_welcome", "signup",
                                            {"user_id": created["user_id"]})]
        out = subprocess.run([sys.executable, "worker.py", "--until-empty"], cwd=APP, env=_env(url),
                             capture_output=True, text=True, timeout=TIMEOUT)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.splitlines() == [f"job {created['job_id']}: sending the welcome email to ada@example.com",
                                           "worker: completed 1, retried 0, dead 0"]
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(text("email_jobs"))).scalar_one() == 0
    finally:
        engine.dispose()
    status, user = _call("GET", address, f"/users/{created['user_id']}")
    assert (status, user) == (200, {"id": created["user_id"], "email": "ada@example.com", "welcomed": True})


@pytest.mark.slow
@pytest.mark.parametrize("server", ["worker in app"], indirect=True)
def test_a_worker_in_the_apps_lifespan_runs_the_signups_job(server: tuple[str, URL]) -> None:
    address, _ = server
    status, created = _call("POST", address, "/signup", {"email": "grace@example.com"})
    assert status == 201, created

    def welcomed() -> bool:
        return _call("GET", address, f"/users/{created['user_id']}")[1].get("welcomed") is True

    wait_for(welcomed, TIMEOUT, "the app's own worker to run the welcome job")


def test_the_page_shows_the_example_files_verbatim() -> None:
    """What docs/fastapi.md shows is what the test above runs."""
    assert files_shown("fastapi.md", APP) == ["app/models.py", "app/db.py", "app/jobs.py", "app/main.py", "worker.py"]
