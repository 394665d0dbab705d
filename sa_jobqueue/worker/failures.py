"""The failure rules: what a failed attempt records, written once.

The worker (both modes) and :func:`sa_jobqueue.testing.run_enqueued` record
failures through :func:`record_failure`, so a job fails the same way
wherever it runs:

* A handler's exception is kept in ``last_error`` (with the end of its
  traceback) and the job retries by the task's policy, or goes to dead
  once its attempts are exhausted.
* :class:`~sa_jobqueue.RetryJob` asks for the next attempt after ``delay``
  or at ``at``.
* A job whose task no worker knows goes to dead at once.
* A handler that returns an awaitable (an ``async def`` behind a sync
  wrapper) failed: its coroutine never ran.
* Whatever goes wrong while recording (a retry time past the scheduling
  horizon, say), the failure is recorded anyway with the task's policy and
  both errors kept: a failure is never lost, and never turned into a
  retry loop that does not count attempts.
"""

from __future__ import annotations

import inspect
import logging
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from ..errors import JobLostError, JobQueueError, RetryJob

if TYPE_CHECKING:
    from ..runnable import RunnableTask

log = logging.getLogger("sa_jobqueue.worker")

_ERROR_LIMIT = 4000


class HandlerReturnedAwaitable(JobQueueError):
    """A sync worker's handler returned an awaitable: it never ran."""


def describe_error(exc: BaseException) -> str:
    """The text kept in ``last_error``: the exception and the end of its traceback."""
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= _ERROR_LIMIT else "…" + text[-_ERROR_LIMIT:]


def unknown_task_error(job: Any, tasks: Iterable[RunnableTask]) -> str:
    known = ", ".join(sorted(t.name for t in tasks)) or "none"
    return f"unknown task {job.task!r}: no handler is registered for it in this worker (registered: {known})"


def refuse_awaitable(value: object) -> Any:
    """Return a handler's return value; raise :class:`HandlerReturnedAwaitable` if it is awaitable.

    A coroutine is closed first, so Python does not warn that it was never awaited.
    """
    if inspect.isawaitable(value):
        close = getattr(value, "close", None)
        if callable(close):
            close()
        raise HandlerReturnedAwaitable(
            f"the handler returned {type(value).__name__}, an awaitable this worker cannot run; "
            "an async def handler needs sa_jobqueue.aio.AsyncWorker"
        )
    return value


@dataclass(frozen=True)
class Failure:
    """A failed attempt, as the job's row will record it."""

    error: str
    task: RunnableTask | None  # None: the task is unknown, the job goes to dead
    delay: timedelta | None = None
    at: datetime | None = None
    discard: bool = False


def failure_of(
    job: Any, task: RunnableTask | None, exc: BaseException | None, tasks: Iterable[RunnableTask] = ()
) -> Failure:
    """The failure to record for ``exc`` raised by ``task``'s handler."""
    if task is None:
        return Failure(unknown_task_error(job, tasks), None, discard=True)
    if isinstance(exc, RetryJob):
        return Failure(f"RetryJob: {exc}", task, delay=exc.delay if exc.at is None else None, at=exc.at)
    assert exc is not None
    return Failure(describe_error(exc), task)


def timeout_failure(task: RunnableTask, seconds: float) -> Failure:
    return Failure(f"timed out after {seconds:g} s", task)


def record_failure(session: Session, repo: Any, job: Any, failure: Failure, *, savepoint: bool = False) -> str:
    """Record ``failure`` on ``session``; return the job's new status.

    Raises :class:`~sa_jobqueue.JobLostError` when the job is no longer
    owned. With ``savepoint`` (a batch's shared transaction) each try runs
    in a SAVEPOINT, so a failed try leaves the batch usable.
    """
    try:
        return _fail(session, repo, job, failure, savepoint)
    except JobLostError:
        raise
    except Exception as exc:
        # The requested retry could not be recorded: record the failure by
        # the task's policy, keeping both errors, so the attempt counts.
        log.warning("job %s: recording its failure as requested failed (%r); recording it by the task's policy",
                    job.id, exc)
        fallback = Failure(f"{failure.error}\n(recording this failure as requested failed: {exc!r})",
                           failure.task, discard=failure.discard)
        return _fail(session, repo, job, fallback, savepoint)


def _fail(session: Session, repo: Any, job: Any, failure: Failure, savepoint: bool) -> str:
    task = failure.task
    if savepoint:
        with session.begin_nested():
            return _fail(session, repo, job, failure, False)
    if task is None:
        return str(repo.fail(session, job, failure.error, discard=True))
    return str(repo.fail(
        session, job, failure.error, delay=failure.delay, at=failure.at, policy=task.retry,
        max_attempts=task.max_attempts, discard=failure.discard,
    ))
