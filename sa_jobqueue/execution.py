"""JobRunner: how one job (lease mode) or one batch (transaction mode) runs.

Each call gets a fresh session from the worker's sessionmaker and runs at
READ COMMITTED whatever the engine's default isolation: under REPEATABLE
READ or SERIALIZABLE, SKIP LOCKED turns into serialization failures.

Outcomes are counted only after the transaction that records them commits,
so a worker's result never reports work that was rolled back.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from . import signals
from .errors import JobLostError, RetryJob
from .logs import job_context
from .registry import Task

if TYPE_CHECKING:
    from .repository import JobRepository
    from .worker import Worker

log = logging.getLogger("sa_jobqueue.worker")

READ_COMMITTED = {"isolation_level": "READ COMMITTED"}
_ERROR_LIMIT = 4000


def describe_error(exc: BaseException) -> str:
    """The text kept in ``last_error``: the exception and the end of its traceback."""
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= _ERROR_LIMIT else "…" + text[-_ERROR_LIMIT:]


def unknown_task_error(job: Any, tasks: Any) -> str:
    known = ", ".join(sorted(t.name for t in tasks)) or "none"
    return f"unknown task {job.task!r}: no handler is registered for it in this worker (registered: {known})"


class JobRunner:
    """Runs jobs for a :class:`~sa_jobqueue.worker.Worker`; called from its threads."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    # -- lease mode ----------------------------------------------------------

    def run_leased(self, repo: JobRepository[Any], job: Any) -> bool:
        """Run one claimed job; its completion is fenced on the claim's token."""
        batched = False
        try:
            with job_context(job):
                batched = self._run_leased(repo, job)
        finally:
            if not batched:
                self.worker._finishing(job)
        return True

    def _run_leased(self, repo: JobRepository[Any], job: Any) -> bool:
        """Return True when the completion was handed to the completion buffer."""
        worker = self.worker
        task = worker.tasks.get(job.task)
        if task is None:
            self._record_failure(repo, job, None, None, 0.0)
            return False
        signals.send(signals.job_started, worker, job=job)
        started = time.monotonic()
        if task.completes_in_batch:
            try:
                task(job, None)
            except BaseException as exc:  # SystemExit from a handler is a failure too
                self._record_failure(repo, job, task, exc, time.monotonic() - started)
                return False
            if worker._completions.add(repo, job, time.monotonic() - started):
                worker._flush_completions()
            return True
        with worker._sessions() as session:
            try:
                with session.begin():
                    session.connection(execution_options=READ_COMMITTED)
                    task(job, session)
                    # The handler's pending writes go first, so that their
                    # errors count as the handler's failure.
                    session.flush()
                    worker._finishing(job)
                    repo.complete(session, job)
            except JobLostError as exc:
                log.warning("worker %s: %s; the handler's writes were rolled back", worker.name, exc)
                worker._count("lost")
                return False
            except BaseException as exc:
                failure: BaseException = exc
            else:
                worker._count("completed")
                signals.send(signals.job_succeeded, worker, job=job, duration=time.monotonic() - started)
                return False
        self._record_failure(repo, job, task, failure, time.monotonic() - started)
        return False

    def _record_failure(
        self, repo: JobRepository[Any], job: Any, task: Task | None, exc: BaseException | None, duration: float
    ) -> None:
        """Record a failed attempt (or an unknown task) in a transaction of its own."""
        worker = self.worker
        worker._finishing(job)
        try:
            with worker._sessions() as session, session.begin():
                session.connection(execution_options=READ_COMMITTED)
                outcome = self.fail(session, repo, job, task, exc)
        except JobLostError as lost:
            log.warning("worker %s: %s", worker.name, lost)
            outcome = "lost"
        worker._count(outcome)
        if outcome != "lost":
            signals.send_failure(worker, job, exc, outcome, duration)

    # -- transaction mode ------------------------------------------------------

    def run_transaction_batch(self) -> bool:
        """Claim a batch and run it in one transaction, each job in a SAVEPOINT.

        Return False when nothing was claimable.
        """
        worker = self.worker
        outcomes: list[str] = []
        with worker._sessions() as session, session.begin():
            session.connection(execution_options=READ_COMMITTED)
            for repo in worker._rotation():
                jobs = repo.claim(
                    session, queues=worker.queues, limit=worker.batch_size or 1,
                    worker=worker.name, lease=worker.lease,
                )
                if jobs:
                    break
            else:
                return False
            succeeded = []
            failed: list[tuple[Any, BaseException | None, str, float]] = []
            durations: dict[int, float] = {}
            for job in jobs:
                started = time.monotonic()
                with job_context(job):
                    outcome, error = self._run_in_savepoint(session, repo, job)
                durations[job.id] = time.monotonic() - started
                if outcome is None:
                    succeeded.append(job)
                else:
                    outcomes.append(outcome)
                    failed.append((job, error, outcome, durations[job.id]))
            # The batch holds its row locks, so the fence always passes here.
            finished = repo.complete_many(session, succeeded)
            outcomes += ["completed" if job.id in finished else "lost" for job in succeeded]
        for outcome in outcomes:
            worker._count(outcome)
        # Committed: now tell the receivers.
        for job in succeeded:
            if job.id in finished:
                signals.send(signals.job_succeeded, worker, job=job, duration=durations[job.id])
        for job, error, status, duration in failed:
            signals.send_failure(worker, job, error, status, duration)
        return True

    def _run_in_savepoint(
        self, session: Session, repo: JobRepository[Any], job: Any
    ) -> tuple[str | None, BaseException | None]:
        """Run one job of a batch in a SAVEPOINT: (None, None) on success, else
        the job's new status as recorded in the batch, and the handler's exception."""
        task = self.worker.tasks.get(job.task)
        if task is None:
            return self.fail(session, repo, job, None, None), None
        signals.send(signals.job_started, self.worker, job=job)
        savepoint = session.begin_nested()
        try:
            task(job, session)
            savepoint.commit()  # flushes the handler's writes inside the savepoint
        except BaseException as exc:  # SystemExit from a handler is a failure too
            savepoint.rollback()
            return self.fail(session, repo, job, task, exc), exc
        return None, None

    # -- failures ----------------------------------------------------------------

    def fail(self, session: Session, repo: JobRepository[Any], job: Any, task: Task | None,
             exc: BaseException | None) -> str:
        """Record a failed attempt on ``session``; return the job's new status.

        ``task`` None means the job's task is unknown to this worker: the job
        goes to dead at once with an error that says so.
        """
        worker = self.worker
        if task is None:
            log.error("worker %s: job %s has unknown task %r", worker.name, job.id, job.task)
            return repo.fail(session, job, unknown_task_error(job, worker.tasks), discard=True)
        if isinstance(exc, RetryJob):
            return repo.fail(
                session, job, f"RetryJob: {exc}", delay=exc.delay if exc.at is None else None,
                at=exc.at, policy=task.retry, max_attempts=task.max_attempts,
            )
        assert exc is not None
        log.info("worker %s: job %s (%s) failed: %r", worker.name, job.id, job.task, exc)
        return repo.fail(session, job, describe_error(exc), policy=task.retry, max_attempts=task.max_attempts)
