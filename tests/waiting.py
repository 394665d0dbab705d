"""Waiting for a state, with a timeout: the one way tests wait on something
asynchronous (a backend's exit, a NOTIFY, a worker's progress)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, text


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, *, every: float = 0.02) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


async def wait_for_async(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    """In a coroutine: poll ``predicate`` (a plain or an ``async`` callable) until
    it is true, yielding to the event loop; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def backend_exists(engine: Engine, pid: int) -> bool:
    """Whether the server still has the backend ``pid``, read in a new
    transaction (pg_stat_activity is a snapshot taken once per transaction)."""
    with engine.connect() as conn:
        return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).scalar())


def terminate_backend(engine: Engine, pid: int, what: str) -> None:
    """End the server process ``pid`` (``pg_terminate_backend``) and wait
    until the server no longer lists it (``what`` names it in a time-out)."""
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        conn.commit()
    wait_for(lambda: not backend_exists(engine, pid), 30, what)
