"""Task: one registered handler and the options its jobs run with.

A :class:`~sa_jobqueue.registry.TaskRegistry` makes these; a worker needs of
its registry only what :class:`Tasks` names, so the worker's modules depend
on this module, not on the registry's decorators and schedules.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, TypeVar

from .arguments import Parameters, parameters_of, returns_value
from .checks import check_bool, check_name, check_timeout, int_between, positive_int
from .configured import ConfiguredTask, JobOptions, check_repository
from .dedupe import Dedupe
from .errors import InvalidArgumentError
from .job_context import JobContext
from .middleware import HandlerCall, Middleware, call_through, call_through_async
from .retry import DEFAULT_RETRY_POLICY, RetryPolicy
from .runnable import Tasks, refuse_async_tasks
from .spec import JobSpec
from .states import DEFAULT_QUEUE, PRIORITY_MAX, PRIORITY_MIN

__all__ = ["Handler", "Task", "Tasks", "check_task", "is_async_handler", "refuse_async_tasks", "takes_session"]

Handler = Callable[..., Any]
"""A job handler: in the arguments form or the job form (:mod:`sa_jobqueue.arguments`)."""

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Task(Generic[P, R]):
    """A registered handler, which is also what you enqueue its jobs through.

    Calling the task calls the handler, as the function it decorates.
    :meth:`enqueue` (and :meth:`enqueue_async` on an ``AsyncSession``)
    takes the handler's own arguments, typed by its signature, and writes
    a job of this task into its ``repository``, on ``queue`` at
    ``priority`` unless :meth:`configure` says otherwise. The handler's
    forms (its arguments, or the job) are in :mod:`sa_jobqueue.arguments`.

    ``max_attempts``, when set, is the limit of its
    jobs enqueued without one of their own (a limit given at enqueue wins;
    20 applies when neither is). ``batch_complete``: a handler that takes no session has
    no writes to commit with its completion, so (in lease mode) its
    completion is buffered and written with others in one statement; False
    gives each such job a completion transaction of its own. ``group_commit``:
    the handler takes the job's session and writes to the database only, so
    (in lease mode) several of its jobs may run in one transaction, each
    handler at most twice (see ``docs/concepts.md``, "Grouped commits").
    ``takes_session``: None reads it from the handler; a bool given must
    agree with a handler in the arguments form."""

    name: str
    handler: Callable[..., Any]
    takes_session: bool | None = None
    retry: RetryPolicy = DEFAULT_RETRY_POLICY
    max_attempts: int | None = None
    batch_complete: bool = True
    timeout: timedelta | None = None
    group_commit: bool = False
    #: The job table its jobs are enqueued into (a JobRepository), or None.
    repository: Any = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    #: The middleware its handler runs in (:mod:`sa_jobqueue.middleware`): the registry's own list.
    middleware: Sequence[Middleware] = field(default=(), compare=False, hash=False, repr=False)

    #: Whether the handler is an ``async def`` (run by :class:`~sa_jobqueue.aio.AsyncWorker` only).
    is_async: bool = field(init=False, repr=False, compare=False)
    #: How the worker calls the handler, and what :meth:`enqueue` takes.
    parameters: Parameters = field(init=False, repr=False, compare=False)
    #: Whether the handler is annotated to return a value (not None): its result is then stored even when None.
    returns_result: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_task(self.name, self.handler, self.retry, self.max_attempts, self.batch_complete, self.timeout,
                   self.group_commit)
        if self.takes_session is not None:
            check_bool("takes_session", self.takes_session)
        given = self.takes_session
        is_async = is_async_handler(self.handler)
        parameters = parameters_of(self.handler, is_async=is_async,
                                   takes_session=takes_session if given is None else lambda _: given)
        if given is not None and given != parameters.takes_session:
            raise InvalidArgumentError(
                "takes_session", f"is {given}, but the handler {'asks' if parameters.takes_session else 'does not ask'}"
                " for the session by its annotation")
        if self.group_commit and not parameters.takes_session:
            raise InvalidArgumentError(
                "group_commit", "needs a handler that takes the job's session (job, session): a handler without "
                "one has no writes to group, and its completions are batched already (batch_complete)")
        if self.repository is not None:
            object.__setattr__(self, "repository", check_repository(self.repository))
        check_name("queue", self.queue)
        int_between("priority", self.priority, PRIORITY_MIN, PRIORITY_MAX)
        # Frozen: set once, here.
        object.__setattr__(self, "takes_session", parameters.takes_session)
        object.__setattr__(self, "is_async", is_async)
        object.__setattr__(self, "parameters", parameters)
        object.__setattr__(self, "returns_result", returns_value(self.handler))

    @property
    def completes_in_batch(self) -> bool:
        return self.batch_complete and not self.takes_session

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the handler itself, as the decorated function."""
        return self.handler(*args, **kwargs)

    def run(self, job: Any, session: Any) -> Any:
        """The worker's call: the handler for ``job``, with ``session`` (the
        job's, or None) when it asks for one, inside the middleware; returns
        what the handler returns (a coroutine, for an ``async def``)."""
        if not self.middleware:
            return self.parameters.call(self.handler, job, session)
        call = HandlerCall(self.name, JobContext(job), session if self.takes_session else None, self.is_async)

        def invoke() -> Any:
            return self.parameters.call(self.handler, job, session)

        if self.is_async:
            return call_through_async(self.middleware, call, invoke)
        return call_through(self.middleware, call, invoke)

    def configure(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: timedelta | float | None = None,
        max_attempts: int | None = None,
        dedupe_key: str | Dedupe | None = None,
        extra: Mapping[str, Any] | None = None,
        repository: Any = None,
        meta: Mapping[str, Any] | None = None,
    ) -> ConfiguredTask[P, R]:
        """This task with the options of the jobs it enqueues (those of
        :meth:`~sa_jobqueue.JobRepository.enqueue`, and the job table);
        checked now, raising :class:`InvalidArgumentError` naming the bad one."""
        configured: ConfiguredTask[P, R] = ConfiguredTask(self, JobOptions(
            queue=queue, priority=priority, run_at=run_at, delay=delay, max_attempts=max_attempts,
            dedupe_key=dedupe_key, extra=dict(extra or {}), repository=repository, meta=meta))
        return configured

    def enqueue(self, session: Any, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Insert a job of this task with the handler's arguments ``args`` and
        ``kwargs``, in ``session``'s transaction, and return it (see
        :meth:`ConfiguredTask.enqueue <sa_jobqueue.configured.ConfiguredTask.enqueue>`)."""
        return self._plain.enqueue(session, *args, **kwargs)

    async def enqueue_async(self, session: Any, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """:meth:`enqueue` on an ``AsyncSession``."""
        return await self._plain.enqueue_async(session, *args, **kwargs)

    def spec(self, *args: P.args, **kwargs: P.kwargs) -> JobSpec:
        """A job of this task as a :class:`~sa_jobqueue.JobSpec`, for ``enqueue_many``."""
        return self._plain.spec(*args, **kwargs)

    def result(self, session: Any, job_id: int) -> R:
        """The stored result of job ``job_id`` of this task's table (:func:`sa_jobqueue.results.read_result`):
        its value when done; raises :class:`~sa_jobqueue.JobFailedError` when it is dead or cancelled,
        :class:`~sa_jobqueue.ResultNotReadyError` while it runs or waits."""
        from .results import read_result

        if self.repository is None:
            raise InvalidArgumentError("repository", f"task {self.name!r} has no job table to read results from")
        value: R = read_result(session, self.repository.model, job_id)
        return value

    @property
    def _plain(self) -> ConfiguredTask[P, R]:
        """This task with no options of its own: its defaults."""
        configured: ConfiguredTask[P, R] = ConfiguredTask(self, _NO_OPTIONS)
        return configured


_NO_OPTIONS = JobOptions()


def check_task(
    name: object, handler: object, retry: object, max_attempts: object, batch_complete: object,
    timeout: object = None, group_commit: object = False,
) -> None:
    """The options of a task, each checked; raise naming the first bad one."""
    check_name("name", name)
    if not callable(handler):
        raise InvalidArgumentError("handler", "must be callable")
    if timeout is not None:
        check_timeout("timeout", timeout)
    if not isinstance(retry, RetryPolicy):
        raise InvalidArgumentError("retry", f"must be a RetryPolicy, got {type(retry).__name__}")
    if max_attempts is not None:
        positive_int("max_attempts", max_attempts)
    check_bool("batch_complete", batch_complete)
    check_bool("group_commit", group_commit)


def is_async_handler(handler: object) -> bool:
    """Whether calling ``handler`` returns a coroutine: an ``async def``
    function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(handler):
        return True
    if inspect.isroutine(handler) or not callable(handler):
        return False
    return inspect.iscoroutinefunction(type(handler).__call__)


def takes_session(handler: Handler) -> bool:
    try:
        signature = inspect.signature(handler)
    except (ValueError, TypeError):
        raise InvalidArgumentError(
            "handler", "has no signature Python can inspect; wrap it in a def taking (job) or (job, session)"
        ) from None
    params = [
        p for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if not params:
        raise InvalidArgumentError("handler", "must accept the job as its first argument")
    return len(params) >= 2 or params[0].kind is inspect.Parameter.VAR_POSITIONAL
