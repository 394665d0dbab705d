"""AsyncJobRepository: the queue verbs on an ``AsyncSession``.

::

    emails = AsyncJobRepository(EmailJob)
    async with AsyncSession(engine) as session, session.begin():
        session.add(User(name="ada"))
        await emails.enqueue(session, "send_welcome", {"user_id": 42}, queue="signup")

Each verb is :class:`~sa_jobqueue.JobRepository`'s of the same name, with the
same arguments, checks, errors and guarantees, awaited: it runs the sync
verb on the ``AsyncSession``'s own ``Session`` through
:meth:`~sqlalchemy.ext.asyncio.AsyncSession.run_sync`, the way SQLAlchemy
runs ORM code under asyncio. So the statements are the same ones (one
:mod:`sa_jobqueue.statements` for both), a bad argument raises the same
:class:`~sa_jobqueue.InvalidArgumentError` before anything is sent, and no
verb commits, rolls back or opens a transaction of its own: an enqueue
commits (or vanishes) with the caller's writes.

Works on SQLAlchemy's two async PostgreSQL drivers: psycopg (async,
``postgresql+psycopg://`` with ``create_async_engine``) and asyncpg
(``postgresql+asyncpg://``). ``enqueue_many`` writes plain rows through COPY
on both (see :mod:`sa_jobqueue.copying`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session

from ..claim import DEFAULT_LEASE
from ..dedupe import Dedupe, EnqueueOutcome
from ..errors import InvalidArgumentError
from ..mixin import JobMixin
from ..reports import LeaseReport, QueueStats, ReapResult
from ..repository import JobRepository
from ..retry import DEFAULT_RETRY_POLICY, RetryPolicy
from ..spec import JobSpec
from ..states import DEFAULT_QUEUE

M = TypeVar("M", bound=JobMixin)


def check_async_session(value: object) -> AsyncSession:
    """A verb's ``session``: an ``AsyncSession`` (or an ``async_scoped_session`` proxying one)."""
    if isinstance(value, async_scoped_session):
        value = value()
    if not isinstance(value, AsyncSession):
        hint = " (a Session takes sa_jobqueue.JobRepository)" if type(value).__name__ in (
            "Session", "scoped_session") else ""
        raise InvalidArgumentError(
            "session", f"must be a sqlalchemy.ext.asyncio.AsyncSession, got {type(value).__name__}{hint}"
        )
    return value


class AsyncJobRepository(Generic[M]):
    """The queue verbs for one job model (one table, any number of queues), on an ``AsyncSession``."""

    def __init__(self, model: type[M], *, notify: bool = True) -> None:
        """As :class:`~sa_jobqueue.JobRepository` (the same checks of
        ``model``, the same ``notify``); its sync twin is :attr:`sync`."""
        #: The :class:`~sa_jobqueue.JobRepository` of the same model, whose verbs these run.
        self.sync: JobRepository[M] = JobRepository(model, notify=notify)
        self.model = model
        self.table = self.sync.table
        self.notify = notify
        self.channel = self.sync.channel
        self.cancel_channel = self.sync.cancel_channel
        self.keep_done = self.sync.keep_done

    def __repr__(self) -> str:
        return f"AsyncJobRepository({self.model.__name__})"

    # -- enqueue ---------------------------------------------------------

    async def enqueue(
        self,
        session: AsyncSession,
        task: str,
        payload: Any = None,
        *,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        run_at: datetime | None = None,
        delay: timedelta | float | None = None,
        max_attempts: int | None = None,
        dedupe_key: str | Dedupe | None = None,
        extra: dict[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> M:
        """:meth:`JobRepository.enqueue <sa_jobqueue.JobRepository.enqueue>`, awaited."""
        return await check_async_session(session).run_sync(
            self.sync.enqueue, task, payload, queue=queue, priority=priority, run_at=run_at, delay=delay,
            max_attempts=max_attempts, dedupe_key=dedupe_key, extra=extra, meta=meta,
        )

    async def enqueue_many(self, session: AsyncSession, jobs: Iterable[JobSpec]) -> list[M]:
        """:meth:`JobRepository.enqueue_many <sa_jobqueue.JobRepository.enqueue_many>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.enqueue_many, jobs)

    async def enqueue_many_fast(self, session: AsyncSession, jobs: Iterable[JobSpec]) -> int:
        """:meth:`JobRepository.enqueue_many_fast <sa_jobqueue.JobRepository.enqueue_many_fast>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.enqueue_many_fast, jobs)

    async def enqueue_many_report(self, session: AsyncSession, jobs: Iterable[JobSpec]) -> list[EnqueueOutcome[M]]:
        """:meth:`JobRepository.enqueue_many_report <sa_jobqueue.JobRepository.enqueue_many_report>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.enqueue_many_report, jobs)

    # -- claim and the fenced verbs --------------------------------------

    async def claim(
        self,
        session: AsyncSession,
        *,
        queues: str | Sequence[str] = DEFAULT_QUEUE,
        limit: int = 1,
        worker: str | None = None,
        lease: timedelta = DEFAULT_LEASE,
    ) -> list[M]:
        """:meth:`JobRepository.claim <sa_jobqueue.JobRepository.claim>`, awaited."""
        return await check_async_session(session).run_sync(
            self.sync.claim, queues=queues, limit=limit, worker=worker, lease=lease
        )

    async def complete(self, session: AsyncSession, job: M) -> None:
        """:meth:`JobRepository.complete <sa_jobqueue.JobRepository.complete>`, awaited."""
        await check_async_session(session).run_sync(self.sync.complete, job)

    async def complete_many(self, session: AsyncSession, jobs: Sequence[M]) -> set[int]:
        """:meth:`JobRepository.complete_many <sa_jobqueue.JobRepository.complete_many>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.complete_many, jobs)

    async def fail(
        self,
        session: AsyncSession,
        job: M,
        error: str,
        *,
        policy: RetryPolicy = DEFAULT_RETRY_POLICY,
        delay: timedelta | None = None,
        at: datetime | None = None,
        max_attempts: int | None = None,
        discard: bool = False,
    ) -> str:
        """:meth:`JobRepository.fail <sa_jobqueue.JobRepository.fail>`, awaited."""
        return await check_async_session(session).run_sync(
            self.sync.fail, job, error, policy=policy, delay=delay, at=at, max_attempts=max_attempts,
            discard=discard,
        )

    async def heartbeat(
        self, session: AsyncSession, jobs: Sequence[M], *, lease: timedelta = DEFAULT_LEASE
    ) -> set[int]:
        """:meth:`JobRepository.heartbeat <sa_jobqueue.JobRepository.heartbeat>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.heartbeat, jobs, lease=lease)

    async def extend_leases(self, session: AsyncSession, jobs: Sequence[M], *, lease: timedelta) -> LeaseReport:
        """:meth:`JobRepository.extend_leases <sa_jobqueue.JobRepository.extend_leases>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.extend_leases, jobs, lease=lease)

    async def hand_back(self, session: AsyncSession, jobs: Sequence[M]) -> set[int]:
        """:meth:`JobRepository.hand_back <sa_jobqueue.JobRepository.hand_back>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.hand_back, jobs)

    async def mark_cancelled(self, session: AsyncSession, job: M, reason: str = "cancelled while running") -> None:
        """:meth:`JobRepository.mark_cancelled <sa_jobqueue.JobRepository.mark_cancelled>`, awaited."""
        await check_async_session(session).run_sync(self.sync.mark_cancelled, job, reason)

    # -- housekeeping ----------------------------------------------------

    async def reap(
        self, session: AsyncSession, *, limit: int = 1000, task_max_attempts: Mapping[str, int] | None = None
    ) -> ReapResult:
        """:meth:`JobRepository.reap <sa_jobqueue.JobRepository.reap>`, awaited."""
        return await check_async_session(session).run_sync(
            self.sync.reap, limit=limit, task_max_attempts=task_max_attempts
        )

    async def cancel(self, session: AsyncSession, job_id: int) -> bool:
        """:meth:`JobRepository.cancel <sa_jobqueue.JobRepository.cancel>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.cancel, job_id)

    async def retry(self, session: AsyncSession, job_id: int) -> bool:
        """:meth:`JobRepository.retry <sa_jobqueue.JobRepository.retry>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.retry, job_id)

    async def purge(
        self,
        session: AsyncSession,
        *,
        statuses: Sequence[str] = ("done", "dead", "cancelled"),
        older_than: timedelta = timedelta(0),
        limit: int = 1000,
    ) -> int:
        """:meth:`JobRepository.purge <sa_jobqueue.JobRepository.purge>`, awaited."""
        return await check_async_session(session).run_sync(
            self.sync.purge, statuses=statuses, older_than=older_than, limit=limit
        )

    async def stats(self, session: AsyncSession) -> list[QueueStats]:
        """:meth:`JobRepository.stats <sa_jobqueue.JobRepository.stats>`, awaited."""
        return await check_async_session(session).run_sync(self.sync.stats)


__all__ = ["AsyncJobRepository", "check_async_session"]
