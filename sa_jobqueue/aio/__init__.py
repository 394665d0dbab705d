"""sa_jobqueue under asyncio: the queue verbs on an ``AsyncSession``
(:class:`AsyncJobRepository`), a worker for ``async def`` handlers
(:class:`AsyncWorker`), results read and waited for (:func:`read_result`,
:func:`wait_for_result`); helpers for tests in :mod:`sa_jobqueue.aio.testing`.

Needs SQLAlchemy's asyncio support (the ``asyncio`` extra:
``pip install 'sa_jobqueue[asyncio]'``, which brings greenlet; add
``asyncpg`` for that driver). The sync API (:mod:`sa_jobqueue`) does not
import this package.
"""

from .repository import AsyncJobRepository
from .results import read_result, wait_for_result
from .worker import AsyncWorker

__all__ = ["AsyncJobRepository", "AsyncWorker", "read_result", "wait_for_result"]
