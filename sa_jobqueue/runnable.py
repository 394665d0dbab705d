"""What a worker needs of a task and of its registry: :class:`RunnableTask`, :class:`Tasks`.

The worker's modules depend on this module, not on :mod:`sa_jobqueue.task`
(which also enqueues, and so reaches the repository) nor on the registry's
decorators and schedules. :class:`~sa_jobqueue.Task` and
:class:`~sa_jobqueue.TaskRegistry` are what they describe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, Protocol

from .errors import InvalidArgumentError
from .retry import RetryPolicy

__all__ = ["RunnableTask", "Tasks", "refuse_async_tasks"]


class RunnableTask(Protocol):
    """A registered task, as a worker runs it (see :class:`~sa_jobqueue.Task` for each attribute)."""

    @property
    def name(self) -> str: ...
    @property
    def handler(self) -> Callable[..., Any]: ...
    @property
    def takes_session(self) -> bool | None: ...
    @property
    def retry(self) -> RetryPolicy: ...
    @property
    def max_attempts(self) -> int | None: ...
    @property
    def batch_complete(self) -> bool: ...
    @property
    def timeout(self) -> timedelta | None: ...
    @property
    def group_commit(self) -> bool: ...
    @property
    def is_async(self) -> bool: ...
    @property
    def completes_in_batch(self) -> bool: ...

    def run(self, job: Any, session: Any) -> Any:
        """Call the handler for ``job`` (with its ``session``, or None); return what it returns."""


class Tasks(Protocol):
    """What a worker asks of its registry: a task by name (None when unknown),
    and every task. :class:`~sa_jobqueue.registry.TaskRegistry` is one."""

    def get(self, name: str) -> RunnableTask | None: ...

    def __iter__(self) -> Iterator[RunnableTask]: ...


def refuse_async_tasks(tasks: Iterable[RunnableTask], parameter: str = "tasks") -> None:
    """Raise naming ``parameter`` when ``tasks`` has an ``async def`` handler:
    code that runs handlers in threads would get a coroutine back and never run it."""
    names = sorted(t.name for t in tasks if t.is_async)
    if names:
        raise InvalidArgumentError(
            parameter, f"has async def handlers ({', '.join(names)}): the thread worker runs sync handlers only; "
            "run this registry with sa_jobqueue.aio.AsyncWorker, which runs both"
        )
