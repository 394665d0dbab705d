"""Checked by mypy in tests/test_typed_tasks.py: each line marked ``# error`` must be
reported, and no other line. Never imported or run."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from sa_jobqueue import JobContext, JobRepository, TaskRegistry
from sa_jobqueue.default import Job

tasks = TaskRegistry(repository=JobRepository(Job))


@tasks.task
def add(x: int, y: int = 2) -> int:
    return x + y


@tasks.task(queue="billing")
def charge(ctx: JobContext, session: Session, order_id: int, *, note: str = "") -> None:
    pass


@tasks.task
def remember(ctx: JobContext, text: str) -> None:
    pass


@tasks.task(max_attempts=3)
async def notify(ctx: JobContext, session: AsyncSession, user_id: int) -> None:
    pass


def enqueue_all(session: Session) -> None:
    add.enqueue(session, 1)
    add.enqueue(session, 1, y=3)
    add.enqueue(session, x=1)
    add.enqueue(session, "one")  # error
    add.enqueue(session)  # error
    add.enqueue(session, 1, z=3)  # error
    charge.enqueue(session, 7, note="first order")
    charge.enqueue(session, order_id="7")  # error
    charge.configure(priority=-1, delay=30).enqueue(session, 7)
    charge.configure(queue="other").enqueue(session, 7, 8)  # error
    remember.enqueue(session, "hello")
    remember.enqueue(session, 42)  # error
    session.add_all([])
    total: int = add(1, 2)
    assert total


async def enqueue_async(session: AsyncSession) -> None:
    await notify.enqueue_async(session, 42)
    await notify.enqueue_async(session, user_id="42")  # error
    await add.enqueue_async(session, 1, 2)


@tasks.task
def session_only(session: Session, n: int) -> None:
    pass


@tasks.task(priority=1)
def session_first(session: Session, ctx: JobContext, n: int) -> None:
    pass


def enqueue_session_forms(session: Session) -> None:
    session_only.enqueue(session, 1)
    session_only.enqueue(session, session, 1)  # error
    session_first.enqueue(session, n=2)
    session_first.enqueue(session, "2")  # error
