"""Task: one registered handler and the options its jobs run with.

A :class:`~sa_jobqueue.registry.TaskRegistry` makes these; a worker needs of
its registry only what :class:`Tasks` names, so the worker's modules depend
on this module, not on the registry's decorators and schedules.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from .checks import check_bool, check_name, check_timeout, positive_int
from .errors import InvalidArgumentError
from .retry import DEFAULT_RETRY_POLICY, RetryPolicy

__all__ = ["Handler", "Task", "Tasks", "check_task", "is_async_handler", "refuse_async_tasks", "takes_session"]

Handler = Callable[..., Any]
"""A job handler: called with the job, and with its session when it takes two arguments."""


@dataclass(frozen=True)
class Task:
    """A registered handler. ``max_attempts``, when set, is the limit of its
    jobs enqueued without one of their own (a limit given at enqueue wins;
    20 applies when neither is). ``batch_complete``: a handler that takes no session has
    no writes to commit with its completion, so (in lease mode) its
    completion is buffered and written with others in one statement; False
    gives each such job a completion transaction of its own. ``group_commit``:
    the handler takes the job's session and writes to the database only, so
    (in lease mode) several of its jobs may run in one transaction, each
    handler at most twice (see ``docs/concepts.md``, "Grouped commits")."""

    name: str
    handler: Handler
    takes_session: bool
    retry: RetryPolicy = DEFAULT_RETRY_POLICY
    max_attempts: int | None = None
    batch_complete: bool = True
    timeout: timedelta | None = None
    group_commit: bool = False

    #: Whether the handler is an ``async def`` (run by :class:`~sa_jobqueue.aio.AsyncWorker` only).
    is_async: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_task(self.name, self.handler, self.retry, self.max_attempts, self.batch_complete, self.timeout,
                   self.group_commit)
        check_bool("takes_session", self.takes_session)
        if self.group_commit and not self.takes_session:
            raise InvalidArgumentError(
                "group_commit", "needs a handler that takes the job's session (job, session): a handler without "
                "one has no writes to group, and its completions are batched already (batch_complete)")
        object.__setattr__(self, "is_async", is_async_handler(self.handler))  # frozen: set once, here

    @property
    def completes_in_batch(self) -> bool:
        return self.batch_complete and not self.takes_session

    def __call__(self, job: Any, session: Any) -> Any:
        if self.takes_session:
            return self.handler(job, session)
        return self.handler(job)


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


def refuse_async_tasks(tasks: Iterable[Task], parameter: str = "tasks") -> None:
    """Raise naming ``parameter`` when ``tasks`` has an ``async def`` handler:
    code that runs handlers in threads would get a coroutine back and never run it."""
    names = sorted(t.name for t in tasks if t.is_async)
    if names:
        raise InvalidArgumentError(
            parameter, f"has async def handlers ({', '.join(names)}): the thread worker runs sync handlers only; "
            "run this registry with sa_jobqueue.aio.AsyncWorker, which runs both"
        )


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


class Tasks(Protocol):
    """What a worker asks of its registry: a task by name (None when unknown),
    and every task. :class:`~sa_jobqueue.registry.TaskRegistry` is one."""

    def get(self, name: str) -> Task | None: ...

    def __iter__(self) -> Iterator[Task]: ...
