"""The dashboard served for a test: ``sa-jobqueue dashboard`` in a process of its own,
on a loopback socket the test bound (handed over by descriptor), over tests/jobapp.py's
job tables in a database of the test's."""

from __future__ import annotations

import http.cookiejar
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.engine import URL
from waiting import wait_for

TESTS = Path(__file__).resolve().parent
TIMEOUT = 120.0
MODELS = ("jobapp:TaskJob", "jobapp:EmailJob", "jobapp:ReportJob")


def get(address: str, path: str, opener: urllib.request.OpenerDirector | None = None) -> tuple[int, str]:
    """GET ``path``: the status and the body, error statuses included."""
    return _send(urllib.request.Request(f"http://{address}{path}"), opener)


def post(address: str, path: str, form: dict[str, str], opener: urllib.request.OpenerDirector | None = None,
         ) -> tuple[int, str]:
    """POST ``form`` (urlencoded) to ``path``: the status and the body."""
    body = urllib.parse.urlencode(form).encode()
    request = urllib.request.Request(f"http://{address}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    return _send(request, opener)


def browser_like() -> urllib.request.OpenerDirector:
    """An HTTP client that keeps cookies, as a browser does."""
    return urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))


def _send(request: urllib.request.Request, opener: urllib.request.OpenerDirector | None) -> tuple[int, str]:
    try:
        with (opener or urllib.request.build_opener()).open(request, timeout=TIMEOUT) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@contextmanager
def serving(url: URL, *options: str) -> Iterator[str]:
    """Serve the dashboard of jobapp's three tables in ``url``'s database; yield its ``host:port``."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{listening.getsockname()[1]}"
    models = [arg for model in MODELS for arg in ("--model", model)]
    env = {**os.environ, "PYTHONPATH": str(TESTS),
           "DATABASE_URL": url.set(drivername="postgresql").render_as_string(hide_password=False)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_jobqueue.cli", "dashboard", *models, "--fd", str(listening.fileno()), *options],
        env=env, pass_fds=[listening.fileno()], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    listening.close()  # the server holds its own copy

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the dashboard exited with {proc.returncode}: {proc.communicate()[1]}")
        try:
            return get(address, "/jobs")[0] == 200
        except OSError:
            return False

    try:
        wait_for(up, TIMEOUT, "the dashboard to serve", every=0.1)
        yield address
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
