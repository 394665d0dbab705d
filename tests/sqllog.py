"""recorded_sql: the statements an engine sends inside a block, for tests that count round trips;
recorded_own_sql: those of the engine a thread worker makes for its own statements (claims, completions)."""

from __future__ import annotations

from collections.abc import Iterator
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


def recorded_own_sql(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that fills with the SQL text of every statement sent by the own engines that
    thread workers make from now on (their claims, batched completions, heartbeats), which
    ``recorded_sql`` of the application's engine does not see. A listener that reads statements
    sends the worker's direct statements through SQLAlchemy, as it would for any listener."""
    sent: list[str] = []
    make_engine = threaded.worker_engine

    def recording_worker_engine(*args: Any, **kwargs: Any) -> Engine:
        own = make_engine(*args, **kwargs)
        event.listen(own, "before_cursor_execute", lambda conn, cursor, statement, *rest: sent.append(statement))
        return own

    monkeypatch.setattr(threaded, "worker_engine", recording_worker_engine)
    return sent
