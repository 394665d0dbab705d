"""What an AsyncWorker is given, turned into what it runs on: repositories,
the sessions of sync handlers, and how many sessions the jobs' pool lends."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session, sessionmaker

from ..errors import InvalidArgumentError
from .repository import AsyncJobRepository

__all__ = ["pool_capacity", "sync_repositories", "sync_sessions"]


def sync_repositories(value: Any) -> Any:
    """The sync twins of AsyncJobRepository values (their verbs are the worker's steps)."""
    if isinstance(value, AsyncJobRepository):
        return value.sync
    if isinstance(value, (list, tuple)):
        return [v.sync if isinstance(v, AsyncJobRepository) else v for v in value]
    return value


def sync_sessions(value: object) -> sessionmaker[Session] | None:
    if value is None or isinstance(value, sessionmaker):
        return value
    if isinstance(value, Engine):
        return sessionmaker(value, expire_on_commit=False)
    raise InvalidArgumentError("sync_bind", f"must be an Engine or a sessionmaker, got {type(value).__name__}")


def pool_capacity(engine: AsyncEngine, concurrency: int) -> int:
    """How many sessions the engine's pool lends at once (``pool_size +
    max_overflow``), at most ``concurrency``; ``concurrency`` for a pool without a bound."""
    pool = engine.sync_engine.pool
    size = getattr(pool, "size", None)
    overflow = getattr(pool, "_max_overflow", None)  # QueuePool keeps it only privately
    if not callable(size) or not isinstance(overflow, int) or overflow < 0:
        return concurrency
    return max(1, min(concurrency, int(size()) + overflow))

