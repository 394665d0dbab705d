"""JobContext: what a handler in the arguments form may ask about its job.

::

    @tasks.task
    def send_welcome(ctx: JobContext, user_id: int) -> None:
        log.info("job %s, attempt %s", ctx.id, ctx.attempt)

A handler asks for it by annotating its first parameter ``JobContext``
(see :mod:`sa_jobqueue.arguments`); the worker builds one per attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["JobContext"]


@dataclass(frozen=True)
class JobContext:
    """The running attempt of one job. ``job`` is the claimed row (a
    detached snapshot of the job model, as a handler in the job form gets
    it); the properties read its columns as they were at the claim."""

    job: Any

    @property
    def id(self) -> int:
        """The job's id."""
        return int(self.job.id)

    @property
    def attempt(self) -> int:
        """This attempt's number: 1 for the first run, 2 for the first retry, …"""
        return int(self.job.attempts)

    @property
    def queue(self) -> str:
        """The queue the job was claimed from."""
        return str(self.job.queue)

    @property
    def task(self) -> str:
        """The job's task name."""
        return str(self.job.task)

    @property
    def max_attempts(self) -> int | None:
        """The job's own attempt limit, or None when its task's applies."""
        return None if self.job.max_attempts is None else int(self.job.max_attempts)

