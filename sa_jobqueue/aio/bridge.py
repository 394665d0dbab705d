"""The bridge from asyncio to the queue's sync steps, through SQLAlchemy's greenlet.

The job lifecycle is written once, as sync functions on a ``Session``
(claim, record a failure, hand back, heartbeat, reap, batched completions).
The asyncio worker runs them unchanged with :func:`in_greenlet`: a
``Session`` bound to the sync face of an ``AsyncEngine``
(``async_engine.sync_engine``) runs its statements on the async driver,
each awaited on the event loop, exactly as
:meth:`AsyncSession.run_sync <sqlalchemy.ext.asyncio.AsyncSession.run_sync>`
runs ORM code. ``greenlet_spawn`` is the function ``run_sync`` is built on
(exported by :mod:`sqlalchemy.util` since 1.4).

What a caller may rely on: the function runs in the event loop's thread,
its I/O does not block the loop, and other tasks run while it waits. It
must not block on a thread lock another task may hold across an await
(none of the steps does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.util import greenlet_spawn

T = TypeVar("T")

__all__ = ["in_greenlet"]


async def in_greenlet(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run the sync ``fn(*args, **kwargs)`` on the event loop; its statements are awaited."""
    result: T = await greenlet_spawn(fn, *args, **kwargs)
    return result
