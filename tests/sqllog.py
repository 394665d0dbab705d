"""recorded_sql: the statements an engine sends inside a block, for tests that count round trips;
recorded_own_sql: those of the engine a thread worker makes for its own statements (claims, completions);
on_own_engines: each such engine, handed to a test as it is made."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Engine, event

from sa_jobqueue.worker import threaded


@contextmanager
def recorded_sql(engine: Engine) -> Iterator[list[str]]:
    """Yield a list that fills with the SQL text of every statement ``engine``
    sends until the block ends."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", record)


def on_own_engines(monkeypatch: pytest.MonkeyPatch, setup: Callable[[Engine], None]) -> None:
    """Call ``setup`` with each own engine that thread workers make from now on, as it is made
    (before the worker sends anything on it)."""
    make_engine = threaded.worker_engine

    def making_worker_engine(*args: Any, **kwargs: Any) -> Engine:
        own = make_engine(*args, **kwargs)
        setup(own)
        return own

    monkeypatch.setattr(threaded, "worker_engine", making_worker_engine)


def recorded_own_sql(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that fills with the SQL text of every statement sent by the own engines that
    thread workers make from now on (their claims, batched completions, heartbeats), which
    ``recorded_sql`` of the application's engine does not see. A listener that reads statements
    sends the worker's direct statements through SQLAlchemy, as it would for any listener."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        sent.append(statement)

    on_own_engines(monkeypatch, lambda own: event.listen(own, "before_cursor_execute", record))
    return sent
