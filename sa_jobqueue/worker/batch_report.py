"""BatchReport: what one transaction-mode batch did, settled once it committed.

A batch (thread or asyncio worker) records each job's outcome as it runs;
in the batch's transaction :meth:`BatchReport.finish` completes the jobs
that ran well in one statement and hands back the unstarted ones; once the
transaction committed, :meth:`BatchReport.settle` counts the outcomes and
sends the signals. What a caller may rely on: nothing is counted or
signalled for a batch that rolled back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from .. import signals
from .context import WorkerContext

log = logging.getLogger("sa_jobqueue.worker")


@dataclass
class BatchReport:
    """What one batch did, counted and signalled once its transaction committed."""

    outcomes: list[str] = field(default_factory=list)
    succeeded: list[tuple[Any, float]] = field(default_factory=list)  # (job, duration)
    failed: list[tuple[Any, BaseException | None, str, float]] = field(default_factory=list)
    unstarted: list[Any] = field(default_factory=list)
    ran_ok: list[tuple[Any, float]] = field(default_factory=list)  # (job, duration), not completed yet

    def group_failed_at_flush(self, name: str, ran: list[tuple[Any, float]], exc: BaseException) -> list[Any]:
        """A group's writes failed at its flush, where no handler is to blame:
        log it and return its jobs, each to run again alone."""
        log.info("worker %s: the writes of a group of %s job(s) failed at its flush (%r); each runs again alone",
                 name, len(ran), exc)
        return [job for job, _ in ran]

    def ran(self, job: Any, outcome: str | None, error: BaseException | None, duration: float) -> None:
        """A job of the batch ran: ``outcome`` None when it succeeded, else its new status."""
        if outcome is None:
            self.ran_ok.append((job, duration))
        else:
            self.outcomes.append(outcome)
            self.failed.append((job, error, outcome, duration))

    def finish(self, session: Session, repo: Any) -> None:
        """In the batch's transaction: complete the jobs that ran well in one
        statement, hand back the unstarted ones."""
        succeeded = self.ran_ok
        # The batch holds its row locks, so the fences always pass here.
        finished = repo.complete_many(session, [job for job, _ in succeeded])
        self.outcomes += ["completed" if job.id in finished else "lost" for job, _ in succeeded]
        self.succeeded = [(job, duration) for job, duration in succeeded if job.id in finished]
        if self.unstarted:
            self.outcomes += ["handed_back"] * len(repo.hand_back(session, self.unstarted))

    def settle(self, ctx: WorkerContext) -> None:
        """The batch committed: count its outcomes and tell the receivers (both drivers)."""
        for outcome in self.outcomes:
            ctx.books.count(outcome)
        if self.unstarted:
            log.info("worker %s: handed back %s claimed job(s) not started: %s", ctx.name, len(self.unstarted),
                     ", ".join(str(job.id) for job in self.unstarted))
        for job, duration in self.succeeded:
            ctx.books.tally(job, "completed")
            signals.send(signals.job_succeeded, ctx.sender, job=job, duration=duration)
        for job, error, status, duration in self.failed:
            ctx.books.tally(job, "failed")
            signals.send_failure(ctx.sender, job, error, status, duration)
