"""Results on an asyncio application: :func:`read_result` and :func:`wait_for_result`, awaited.

As :mod:`sa_jobqueue.results` (the same outcomes and errors): the read runs
the sync one on the ``AsyncSession``'s own ``Session``; the wait LISTENs on
the table's results channel through an :class:`~sa_jobqueue.aio.listener.AsyncListener`
of its own (psycopg's async driver or asyncpg), reading the row again on
each notification naming the job and every ``poll_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from ..channels import results_channel_name
from ..connections import driver_connect
from ..errors import InvalidArgumentError, ResultNotReadyError, ResultTimeoutError
from ..results import check_wait
from ..results import read_result as read_result_sync
from .bridge import in_greenlet
from .listener import AsyncListener
from .repository import check_async_session

__all__ = ["read_result", "wait_for_result"]


async def read_result(session: AsyncSession, model: Any, job_id: int) -> Any:
    """:func:`sa_jobqueue.results.read_result` on an ``AsyncSession``."""
    checked = check_async_session(session)
    return await checked.run_sync(read_result_sync, model, job_id)


async def wait_for_result(
    engine: AsyncEngine, model: Any, job_id: int, *, timeout: float, poll_interval: float = 1.0
) -> Any:
    """:func:`sa_jobqueue.results.wait_for_result` on an ``AsyncEngine``: the job's result once it
    finishes (or its error); :class:`~sa_jobqueue.ResultTimeoutError` after ``timeout`` seconds."""
    if not isinstance(engine, AsyncEngine):
        raise InvalidArgumentError("engine", f"must be an AsyncEngine, got {type(engine).__name__}")
    table, job_id, timeout, poll_interval = check_wait(model, job_id, timeout, poll_interval)
    deadline = time.monotonic() + timeout
    woken = asyncio.Event()

    def on_notify(channel: str, payload: str) -> None:
        if str(job_id) in payload.split(","):
            woken.set()

    connect = driver_connect(engine.sync_engine)
    listener = AsyncListener(lambda: in_greenlet(connect), [results_channel_name(table.name)], on_notify=on_notify,
                             application_name=None)
    listener.start()
    try:
        # Read only once it LISTENs: a completion after the read is then notified.
        await asyncio.wait_for(listener.connected.wait(), max(0.0, deadline - time.monotonic()))
        while True:
            woken.clear()
            try:
                async with AsyncSession(engine) as session:
                    return await session.run_sync(read_result_sync, model, job_id)
            except ResultNotReadyError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResultTimeoutError(job_id, timeout)
            try:
                await asyncio.wait_for(woken.wait(), min(poll_interval, left))
            except asyncio.TimeoutError:
                pass
    except asyncio.TimeoutError:
        raise ResultTimeoutError(job_id, timeout) from None
    finally:
        await listener.stop()
