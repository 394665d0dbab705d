"""Running enqueued jobs inline, in a test's own transaction, committing nothing.

The helpers :mod:`sa_jobqueue.testing` offers for users' test suites (see
docs/testing.md), and :mod:`sa_jobqueue.aio.testing` runs on an
``AsyncSession``; kept apart from the worker, which they do not need:

* ``transactional_session(engine)``: a Session joined to an outer transaction
  that is rolled back at exit (the SAVEPOINT-per-test pattern);
* ``enqueued(session, repository, ...)``: the jobs as that session sees them;
* ``run_enqueued(session, repository, registry, ...)``: claim and run them
  inline, each in a SAVEPOINT of the session's transaction, with the jobs
  their handlers enqueue, and return a :class:`RunResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.orm import Session

from .checks import check_bool, check_name, check_queues, check_session, positive_int
from .errors import InvalidArgumentError, JobQueueError, RetryJob
from .mixin import JobMixin
from .registry import TaskRegistry
from .repository import JobRepository, check_repositories
from .runnable import RunnableTask
from .states import DEAD, PENDING, STATUSES
from .worker.failures import failure_of, record_failure, refuse_awaitable

M = TypeVar("M", bound=JobMixin)


@dataclass(frozen=True)
class JobRun:
    """One job :func:`run_enqueued` ran: the job as claimed (``attempts``
    counted), its outcome (``completed``, ``pending`` for a retry, or
    ``dead``), the round it ran in (from 1) and, for a failure, the exception."""

    job: Any
    outcome: str
    round: int
    error: BaseException | None = None


@dataclass(frozen=True)
class RunResult:
    """What :func:`run_enqueued` ran, in run order."""

    runs: tuple[JobRun, ...]
    rounds: int

    def _jobs(self, outcome: str) -> list[Any]:
        return [run.job for run in self.runs if run.outcome == outcome]

    @property
    def completed(self) -> list[Any]:
        """The jobs whose handler returned; their writes are in the session's transaction."""
        return self._jobs(COMPLETED)

    @property
    def retried(self) -> list[Any]:
        """The jobs that failed (or raised RetryJob) and went back to pending."""
        return self._jobs(PENDING)

    @property
    def dead(self) -> list[Any]:
        """The jobs that failed for good, or whose task has no handler."""
        return self._jobs(DEAD)

    @property
    def tasks(self) -> list[str]:
        """The task name of every job run, in run order: handy in assertions."""
        return [run.job.task for run in self.runs]


class MaxRoundsError(JobQueueError, AssertionError):
    """:func:`run_enqueued` ran ``max_rounds`` rounds and runnable jobs remain:
    most likely handlers that enqueue each other forever. ``result`` holds
    what ran; the jobs that ran stay done (or failed) in the transaction."""

    def __init__(self, max_rounds: int, remaining: int, result: RunResult) -> None:
        super().__init__(
            f"{remaining} runnable job(s) left after max_rounds={max_rounds} rounds of run_enqueued(); "
            "do handlers enqueue each other forever? Raise max_rounds if the chain is meant to be this long"
        )
        self.max_rounds = max_rounds
        self.remaining = remaining
        self.result = result


COMPLETED = "completed"


def _check_repository(value: object) -> JobRepository[Any]:
    if not isinstance(value, JobRepository):
        raise InvalidArgumentError("repository", f"must be a JobRepository, got {type(value).__name__}")
    return value


def _optional_queues(queue: object) -> list[str] | None:
    return None if queue is None else check_queues(queue, "queue")


def enqueued(
    session: Session,
    repository: JobRepository[M],
    *,
    queue: str | Sequence[str] | None = None,
    task: str | None = None,
    status: str | Sequence[str] | None = PENDING,
) -> list[M]:
    """The jobs of ``repository``'s table as ``session`` sees them, uncommitted rows included.

    Filters: ``queue`` (a name or names; None for all), ``task`` (None for
    all), ``status`` (one of :data:`~sa_jobqueue.STATUSES` or several; None
    for all; the default, ``pending``, includes jobs scheduled in the future).
    Ordered by id, i.e. enqueue order. The jobs are detached snapshots
    (:mod:`sa_jobqueue.snapshot`), like the ones ``enqueue`` returns, so
    listing them leaves the session's identity map alone.
    """
    session = check_session(session)
    repo = _check_repository(repository)
    t = repo.table
    stmt = select(*repo.snapshots.columns).order_by(t.c.id)
    queues = _optional_queues(queue)
    if queues is not None:
        stmt = stmt.where(t.c.queue.in_(queues))
    if task is not None:
        stmt = stmt.where(t.c.task == check_name("task", task))
    if status is not None:
        statuses = [status] if isinstance(status, str) else list(status)
        bad = [s for s in statuses if s not in STATUSES]
        if bad or not statuses:
            raise InvalidArgumentError("status", f"name statuses among {', '.join(STATUSES)}, got {statuses!r}")
        stmt = stmt.where(t.c.status.in_(statuses))
    result: list[M] = repo.snapshots.all(session.execute(stmt).all())
    return result


def _runnable_queues(session: Session, repo: JobRepository[Any], queues: list[str] | None) -> tuple[list[str], int]:
    """The queues holding runnable jobs as the session sees them, and how many such jobs."""
    t = repo.table
    stmt = (
        select(t.c.queue, func.count())
        .where(t.c.status == PENDING, t.c.run_at <= func.now())
        .group_by(t.c.queue)
        .order_by(t.c.queue)
    )
    if queues is not None:
        stmt = stmt.where(t.c.queue.in_(queues))
    rows = session.execute(stmt).all()
    return [row[0] for row in rows], sum(int(row[1]) for row in rows)


def run_enqueued(
    session: Session,
    repositories: JobRepository[Any] | Sequence[JobRepository[Any]],
    registry: TaskRegistry,
    *,
    queue: str | Sequence[str] | None = None,
    limit: int | None = None,
    raise_errors: bool = True,
    max_rounds: int = 100,
) -> RunResult:
    """Run the runnable jobs ``session`` sees, inline, in the session's own transaction.

    Nothing is committed: each round claims every runnable job of
    ``queue`` (a name or names; None for every queue) from each repository,
    then runs each handler with ``session`` inside a SAVEPOINT, and completes
    the job in that SAVEPOINT (so a handler's writes and its job's completion
    stand or fall together, as in the worker). Jobs the handlers enqueue run in
    the next round; rounds go on until no runnable job is left.

    A failing handler's SAVEPOINT is rolled back and the failure is recorded
    as the worker records it (retry with the task's policy, or ``dead``);
    then, with ``raise_errors`` (the default), the handler's exception is
    re-raised so the test fails with its real traceback. :class:`RetryJob` is
    not an error: the job is put back as asked and nothing is raised. A job
    whose task has no handler goes to ``dead``, and with ``raise_errors``
    raises :class:`LookupError`. A retry that is runnable at once (a policy
    without delay) runs again in the next round; one in the future stays
    pending, as in production.

    ``limit`` caps the number of jobs run in this call (the rest stay
    pending); ``max_rounds`` bounds the rounds, and :class:`MaxRoundsError`
    is raised when runnable jobs remain after the last one.

    ``now()`` is the transaction's start time in PostgreSQL, so within one
    transaction a job scheduled in the future never becomes runnable.
    """
    __tracebackhide__ = True
    return run_inline(session, repositories, registry, queue=queue, limit=limit, raise_errors=raise_errors,
                      max_rounds=max_rounds)


#: How :func:`run_inline` calls a handler: ``call(task, job, session)``.
HandlerCall = Callable[[RunnableTask, Any, Session], None]


def _call_sync(task: RunnableTask, job: Any, session: Session) -> None:
    refuse_awaitable(task.run(job, session))


def run_inline(
    session: Session,
    repositories: JobRepository[Any] | Sequence[JobRepository[Any]],
    registry: TaskRegistry,
    *,
    queue: str | Sequence[str] | None = None,
    limit: int | None = None,
    raise_errors: bool = True,
    max_rounds: int = 100,
    call: HandlerCall = _call_sync,
) -> RunResult:
    """:func:`run_enqueued`, with ``call`` running each handler (the asyncio
    helpers pass one that awaits ``async def`` handlers on the ``AsyncSession``)."""
    __tracebackhide__ = True
    session = check_session(session)
    repos = check_repositories(repositories)
    if not isinstance(registry, TaskRegistry):
        raise InvalidArgumentError("registry", f"must be a TaskRegistry, got {type(registry).__name__}")
    queues = _optional_queues(queue)
    if limit is not None:
        limit = positive_int("limit", limit)
    raise_errors = check_bool("raise_errors", raise_errors)
    max_rounds = positive_int("max_rounds", max_rounds)
    runs: list[JobRun] = []
    for round_no in range(1, max_rounds + 2):
        # Claim the whole round first, so that a round is exactly what was
        # runnable when it began, whichever table the handlers enqueue into.
        claimed: list[tuple[JobRepository[Any], Any]] = []
        for repo in repos:
            names, count = _runnable_queues(session, repo, queues)
            if limit is not None:
                count = min(count, limit - len(runs) - len(claimed))
            if not names or count <= 0:
                continue
            if round_no > max_rounds:
                raise MaxRoundsError(max_rounds, count, RunResult(tuple(runs), max_rounds))
            claimed += [(repo, job) for job in repo.claim(session, queues=names, limit=count, worker=_WORKER_NAME)]
        if not claimed:
            return RunResult(tuple(runs), round_no - 1)
        for repo, job in claimed:
            runs.append(_run_one(session, repo, registry, job, round_no, raise_errors, call))
        if limit is not None and len(runs) >= limit:
            return RunResult(tuple(runs), round_no)
    raise AssertionError("unreachable")  # pragma: no cover


_WORKER_NAME = "sa_jobqueue.testing"


def _run_one(
    session: Session, repo: JobRepository[Any], registry: TaskRegistry, job: Any, round_no: int, raise_errors: bool,
    call: HandlerCall,
) -> JobRun:
    __tracebackhide__ = True
    task = registry.get(job.task)
    if task is None:
        failure = failure_of(job, None, None, registry)
        outcome = record_failure(session, repo, job, failure, savepoint=True)
        missing = LookupError(failure.error)
        if raise_errors:
            raise missing
        return JobRun(job, outcome, round_no, missing)
    try:
        with session.begin_nested():
            call(task, job, session)
            session.flush()  # the handler's pending writes: their errors are the handler's failure
            repo.complete(session, job)
    except BaseException as exc:  # SystemExit from a handler is a failure too, as in the worker
        outcome = record_failure(session, repo, job, failure_of(job, task, exc), savepoint=True)
        if raise_errors and not isinstance(exc, RetryJob):
            raise
        return JobRun(job, outcome, round_no, exc)
    return JobRun(job, COMPLETED, round_no)


@contextmanager
def transactional_session(bind: Engine | Connection, **session_options: Any) -> Iterator[Session]:
    """A Session inside an outer transaction that is rolled back at exit: nothing commits.

    The session joins the outer transaction with
    ``join_transaction_mode="create_savepoint"``, so the code under test may
    call ``session.commit()`` and ``session.rollback()``: they release or roll
    back a SAVEPOINT, never the outer transaction. ``bind`` is an Engine (a
    connection is taken from it and returned at exit) or a Connection not in
    a transaction yet. ``session_options`` go to ``Session()``.
    """
    with ExitStack() as stack:
        if isinstance(bind, Engine):
            connection = stack.enter_context(bind.connect())
        elif isinstance(bind, Connection):
            connection = bind
        else:
            raise InvalidArgumentError("bind", f"must be an Engine or a Connection, got {type(bind).__name__}")
        outer = connection.begin()
        session_options.setdefault("join_transaction_mode", "create_savepoint")
        session = Session(bind=connection, **session_options)
        try:
            yield session
        finally:
            session.close()
            if outer.is_active:
                outer.rollback()


__all__ = ["JobRun", "MaxRoundsError", "RunResult", "enqueued", "run_enqueued", "transactional_session"]
