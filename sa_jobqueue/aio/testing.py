"""Helpers for the tests of asyncio applications: :mod:`sa_jobqueue.testing`
on an ``AsyncSession``, committing nothing (see docs/testing.md).

* ``transactional_session(engine)``: an ``AsyncSession`` joined to an outer
  transaction that is rolled back at exit (the SAVEPOINT-per-test pattern);
* ``enqueued(session, repository, ...)``: the jobs as that session sees
  them, uncommitted rows included;
* ``run_enqueued(session, repository, registry, ...)``: claim and run them
  inline, each in a SAVEPOINT of the session's transaction, with the jobs
  their handlers enqueue, and return a :class:`~sa_jobqueue.testing.RunResult`.

Each is the sync helper of the same name, run on the ``AsyncSession``'s own
``Session`` through ``run_sync``, so its checks, errors and rules are the
same; ``run_enqueued`` awaits ``async def`` handlers with the
``AsyncSession`` itself and calls sync ones with its ``Session``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.util import await_only

from .. import inline
from ..errors import InvalidArgumentError
from ..mixin import JobMixin
from ..registry import TaskRegistry
from ..repository import JobRepository
from ..runnable import RunnableTask
from ..states import PENDING
from ..worker.failures import refuse_awaitable
from .repository import AsyncJobRepository, check_async_session

M = TypeVar("M", bound=JobMixin)


@asynccontextmanager
async def transactional_session(
    bind: AsyncEngine | AsyncConnection, **session_options: Any
) -> AsyncIterator[AsyncSession]:
    """An ``AsyncSession`` inside an outer transaction that is rolled back at
    exit: nothing commits. As :func:`sa_jobqueue.testing.transactional_session`:
    the code under test may ``await session.commit()`` or ``rollback()``,
    which release or roll back a SAVEPOINT only. ``bind`` is an
    ``AsyncEngine`` (a connection is taken from it and returned at exit) or
    an ``AsyncConnection`` not in a transaction yet."""
    async with AsyncExitStack() as stack:
        if isinstance(bind, AsyncEngine):
            connection = await stack.enter_async_context(bind.connect())
        elif isinstance(bind, AsyncConnection):
            connection = bind
        else:
            raise InvalidArgumentError(
                "bind", f"must be an AsyncEngine or an AsyncConnection, got {type(bind).__name__}"
            )
        outer = await connection.begin()
        session_options.setdefault("join_transaction_mode", "create_savepoint")
        session = AsyncSession(bind=connection, **session_options)
        try:
            yield session
        finally:
            await session.close()
            if outer.is_active:
                await outer.rollback()


def _sync(repository: object, parameter: str = "repository") -> JobRepository[Any]:
    if isinstance(repository, AsyncJobRepository):
        return repository.sync
    raise InvalidArgumentError(parameter, f"must be an AsyncJobRepository, got {type(repository).__name__}")


async def enqueued(
    session: AsyncSession,
    repository: AsyncJobRepository[M],
    *,
    queue: str | Sequence[str] | None = None,
    task: str | None = None,
    status: str | Sequence[str] | None = PENDING,
) -> list[M]:
    """:func:`sa_jobqueue.testing.enqueued`, awaited."""
    sync: JobRepository[M] = _sync(repository)
    return await check_async_session(session).run_sync(
        inline.enqueued, sync, queue=queue, task=task, status=status
    )


async def run_enqueued(
    session: AsyncSession,
    repositories: AsyncJobRepository[Any] | Sequence[AsyncJobRepository[Any]],
    registry: TaskRegistry,
    *,
    queue: str | Sequence[str] | None = None,
    limit: int | None = None,
    raise_errors: bool = True,
    max_rounds: int = 100,
) -> inline.RunResult:
    """:func:`sa_jobqueue.testing.run_enqueued`, awaited: an ``async def``
    handler is awaited with ``session`` itself, a sync one is called with
    the ``AsyncSession``'s own ``Session``; both inside the job's SAVEPOINT."""
    listed = [repositories] if isinstance(repositories, AsyncJobRepository) else repositories
    if not isinstance(listed, (list, tuple)):
        raise InvalidArgumentError(
            "repositories", f"give one or more AsyncJobRepository, got {type(repositories).__name__}"
        )
    sync = [_sync(r, "repositories") for r in listed]
    outer = check_async_session(session)

    def call(task: RunnableTask, job: Any, sync_session: Session) -> None:
        if not task.is_async:
            refuse_awaitable(task.run(job, sync_session))
            return
        # In run_sync's greenlet: await the coroutine on the loop. Its own
        # statements on ``outer`` run in greenlets of their own, on the same
        # connection and transaction (this one waits meanwhile).
        await_only(task.run(job, outer))

    return await outer.run_sync(
        inline.run_inline, sync, registry, queue=queue, limit=limit, raise_errors=raise_errors,
        max_rounds=max_rounds, call=call,
    )


__all__ = ["enqueued", "run_enqueued", "transactional_session"]
