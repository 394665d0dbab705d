"""recorded_sql: the statements an engine sends inside a block, for tests that count round trips."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event


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
