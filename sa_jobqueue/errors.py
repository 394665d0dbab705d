"""The exception tree of sa_jobqueue.

::

    JobQueueError                      base of every error raised here
    ├── InvalidArgumentError           bad input to a verb; ``.parameter`` names it
    │                                  (also a ValueError); nothing was written
    ├── JobTableError                  a model is not a usable job table
    │                                  (also a TypeError)
    ├── JobLostError                   a fenced write found the job no longer
    │                                  owned by the caller (lease expired and
    │                                  the job was reaped or re-claimed)
    ├── JobFailedError                 a result was asked of a dead or cancelled job
    ├── ResultNotReadyError            a result was asked of an unfinished job
    ├── ResultTimeoutError             no result within the wait's timeout (also a TimeoutError)
    ├── JobNotFoundError               no such job (also a LookupError)
    └── WorkerStuckError               Worker.run() gave up: more threads are
                                       stuck in handlers past their deadline
                                       than max_stuck_slots allows

Handlers may raise :class:`RetryJob` to ask for another attempt at a given
time; it is a control-flow signal, not an error, and is not part of the tree.
"""

from __future__ import annotations

from datetime import datetime, timedelta

_SHOW = 60


def shown(value: object) -> str:
    """``repr(value)``, cut short: an error message never carries a huge value."""
    text = repr(value)
    return text if len(text) <= _SHOW else f"{text[:_SHOW]}… ({len(text)} characters)"


class JobQueueError(Exception):
    """Base class of every error raised by sa_jobqueue."""


class InvalidArgumentError(JobQueueError, ValueError):
    """A verb got an argument it cannot accept.

    Raised before any statement is sent, so the database is left as it was.
    ``parameter`` is the name of the offending argument.
    """

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter


class JobTableError(JobQueueError, TypeError):
    """A model passed to :class:`~sa_jobqueue.JobRepository` is not a job table.

    Either it does not use :class:`~sa_jobqueue.JobMixin`, is not mapped, or it
    replaced ``__table_args__`` and so lost the indexes the claim depends on.
    """


class JobLostError(JobQueueError):
    """The caller no longer owns the job it tried to finish.

    Every write after a claim is fenced on the claim's ``lock_token``. When the
    lease expired and the job was reaped (and maybe claimed by another worker),
    the stale write changes nothing and raises this; the caller's transaction
    should be rolled back so that the handler's own writes do not commit.
    """

    def __init__(self, job_id: int, verb: str) -> None:
        super().__init__(
            f"job {job_id}: cannot {verb}, this worker no longer owns it "
            "(its lease expired and it was reaped or claimed again)"
        )
        self.job_id = job_id
        self.verb = verb


class JobFailedError(JobQueueError):
    """The job whose result was asked for ended without one: ``dead`` (its
    attempts spent, or discarded) or ``cancelled``. ``error`` is its last
    error, as stored (the traceback of the last failed attempt)."""

    def __init__(self, job_id: int, status: str, error: str | None) -> None:
        last = (error or "").strip().splitlines()
        super().__init__(f"job {job_id} is {status}" + (f": {last[-1]}" if last else ""))
        self.job_id = job_id
        self.status = status
        self.error = error


class ResultNotReadyError(JobQueueError):
    """The job whose result was asked for has not finished (pending or running)."""

    def __init__(self, job_id: int, status: str) -> None:
        super().__init__(f"job {job_id} is {status}: no result yet")
        self.job_id = job_id
        self.status = status


class ResultTimeoutError(JobQueueError, TimeoutError):
    """Waiting for a job's result took longer than the ``timeout`` given; the job runs on."""

    def __init__(self, job_id: int, timeout: float) -> None:
        super().__init__(f"job {job_id}: no result within {timeout:g} s")
        self.job_id = job_id


class JobNotFoundError(JobQueueError, LookupError):
    """No job of that id is in the table: never enqueued there, purged, or
    completed on a table that deletes finished jobs (which keeps no result)."""

    def __init__(self, job_id: int, table: str) -> None:
        super().__init__(f"job {job_id} is not in {table} (purged, or its table does not keep finished jobs)")
        self.job_id = job_id


class WorkerStuckError(JobQueueError):
    """Raised by :meth:`Worker.run` when more threads are stuck in handlers
    past their deadline than ``max_stuck_slots`` allows.

    A Python thread cannot be killed: the worker replaced each stuck one and
    now stops, so that the process supervisor starts a fresh process. The
    stuck jobs' failures are recorded; jobs still running are left to their
    lease.
    """


class RetryJob(Exception):
    """Raised by a handler to ask for another attempt later.

    Give either ``delay`` (a non-negative :class:`~datetime.timedelta` or
    number of seconds) or ``at`` (an aware datetime), or neither for the
    task's retry policy. The attempt still counts towards ``max_attempts``;
    when attempts are exhausted the job goes to ``dead`` as with any failure.

    The arguments are checked here, where the handler raises it: a bad one
    raises :class:`InvalidArgumentError` naming it, which the worker then
    records as the handler's failure (so the attempt counts).
    """

    def __init__(
        self,
        reason: str = "retry requested by the handler",
        *,
        delay: timedelta | float | None = None,
        at: datetime | None = None,
    ) -> None:
        super().__init__(reason)
        if delay is not None and at is not None:
            raise InvalidArgumentError("delay", "give either delay or at, not both")
        if delay is not None:
            if isinstance(delay, bool) or not isinstance(delay, (timedelta, int, float)):
                raise InvalidArgumentError("delay", f"must be a timedelta or a number of seconds, got {delay!r}")
            if not isinstance(delay, timedelta):
                if delay != delay or delay in (float("inf"), float("-inf")):
                    raise InvalidArgumentError("delay", f"must be a finite number of seconds, got {delay!r}")
                delay = timedelta(seconds=delay)
            if delay < timedelta(0):
                raise InvalidArgumentError("delay", f"must not be negative, got {delay!r}")
        if at is not None:
            if not isinstance(at, datetime):
                raise InvalidArgumentError("at", f"must be an aware datetime, got {at!r}")
            if at.tzinfo is None or at.utcoffset() is None:
                raise InvalidArgumentError(
                    "at", f"must be an aware datetime (with a tzinfo, e.g. datetime.now(timezone.utc)), got {at!r}"
                )
        self.delay: timedelta | None = delay
        self.at = at
