"""Job context for logging: which job a log record was written for.

While a worker runs a job (the handler, the recording of its failure, its
completion), :data:`current_job` holds that job's :class:`JobContext` in the
running thread. :class:`JobLogFilter` copies it onto every log record that
passes through a handler it is attached to, so the standard ``logging``
format can show it, whichever logger wrote the record (the handler's own,
SQLAlchemy's, the worker's)::

    handler = logging.StreamHandler()
    handler.addFilter(JobLogFilter())
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s [job %(job_id)s %(job_task)s q=%(job_queue)s "
        "attempt %(job_attempt)s] %(name)s: %(message)s"
    ))

Outside a job the four attributes are ``None``. Context variables are per
thread, so the worker's concurrent jobs never mix.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobContext:
    """The job a log record belongs to: id, task, queue and attempt (1 for the first run)."""

    job_id: int
    task: str
    queue: str
    attempt: int


current_job: ContextVar[JobContext | None] = ContextVar("sa_jobqueue_current_job", default=None)


class job_context:  # noqa: N801 - used as a function: ``with job_context(job):``
    """Make ``job`` (a claimed job) the current job of this thread for the block.

    A class rather than a generator: it runs around every job a worker runs,
    and a class's ``__enter__``/``__exit__`` cost a fraction of a generator's."""

    __slots__ = ("context", "_token")

    def __init__(self, job: Any) -> None:
        self.context = JobContext(job_id=job.id, task=job.task, queue=job.queue, attempt=job.attempts)

    def __enter__(self) -> JobContext:
        self._token = current_job.set(self.context)
        return self.context

    def __exit__(self, *exc: object) -> None:
        current_job.reset(self._token)


class JobLogFilter(logging.Filter):
    """Adds ``job_id``, ``job_task``, ``job_queue`` and ``job_attempt`` to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = current_job.get()
        record.job_id = context.job_id if context else None
        record.job_task = context.task if context else None
        record.job_queue = context.queue if context else None
        record.job_attempt = context.attempt if context else None
        return True


__all__ = ["JobContext", "JobLogFilter", "current_job", "job_context"]
