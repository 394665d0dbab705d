"""TaskRegistry: handlers by task name, each with its retry policy.

::

    tasks = TaskRegistry()

    @tasks.task("send_welcome", max_attempts=5)
    def send_welcome(job: EmailJob, session: Session) -> None:
        session.add(Sent(user_id=job.payload["user_id"]))

A handler takes the claimed job, and optionally the job's session as a
second argument. Its writes on that session commit together with the job's
completion (exactly once); it must not commit or roll back the session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, overload

from .checks import check_name, check_timeout
from .configured import check_repository
from .errors import InvalidArgumentError
from .job_context import JobContext
from .middleware import Middleware, check_middleware
from .retry import DEFAULT_RETRY_POLICY, RetryPolicy
from .schedule import Periodic, check_cron
from .states import DEFAULT_QUEUE
from .task import Handler, Task, check_task

__all__ = ["Handler", "Task", "TaskRegistry"]

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

F = TypeVar("F", bound=Handler)
P = ParamSpec("P")
R = TypeVar("R")
#: The session a handler asks for; as strings, so that the core never imports SQLAlchemy's asyncio extension.
S = TypeVar("S", "Session", "AsyncSession")


class TaskRegistry:
    """Handlers by task name. One registry may serve several workers.

    ``repository``: the job table (a JobRepository) its tasks enqueue into
    unless a task names its own. ``middleware``: the chain every handler of
    the registry runs in, first outermost (:mod:`sa_jobqueue.middleware`);
    :attr:`middleware` is that list, and :meth:`use` appends to it."""

    def __init__(self, *, repository: Any = None, middleware: Sequence[Middleware] = ()) -> None:
        self._tasks: dict[str, Task[..., Any]] = {}
        self._periodic: list[Periodic] = []
        # @periodic applied before @task (written below it): resolved by handler later.
        self._pending: list[tuple[Handler, dict[str, Any]]] = []
        self.repository = None if repository is None else check_repository(repository)
        #: The middleware chain, shared by every task of the registry (so :meth:`use` reaches them all).
        self.middleware: list[Middleware] = check_middleware(middleware)

    def use(self, middleware: Middleware) -> Middleware:
        """Add ``middleware`` to the end of the chain (innermost); returns it, so that it can decorate."""
        self.middleware.extend(check_middleware([middleware]))
        return middleware

    def register(
        self,
        name: str,
        handler: Callable[P, R],
        *,
        retry: RetryPolicy = DEFAULT_RETRY_POLICY,
        max_attempts: int | None = None,
        batch_complete: bool = True,
        timeout: timedelta | float | None = None,
        group_commit: bool = False,
        repository: Any = None,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
    ) -> Task[P, R]:
        """Register ``handler`` for ``name``; a name can be registered once.

        ``timeout`` (a timedelta or seconds): the job's deadline. Past it the
        worker stops extending the job's lease, cancels its statement on the
        server and records a failure that retries or goes dead by ``retry``
        and ``max_attempts``; a late return of the handler commits nothing.
        None (the default) uses the worker's ``job_timeout``.

        ``group_commit``: the handler takes the job's session and only writes
        to the database, so a lease-mode worker may run several of its jobs in
        one transaction; when one fails, the others run again in
        transactions of their own (docs/concepts.md, "Grouped commits").

        ``repository``, ``queue``, ``priority``: where :meth:`Task.enqueue`
        puts its jobs unless :meth:`Task.configure` says otherwise (the job
        table defaults to the registry's).

        ``name`` is any non-blank string of at most 128 characters without NUL
        or lone surrogates (it is stored in the jobs' ``task`` column);
        ``batch_complete`` must be a bool. Raises :class:`InvalidArgumentError`
        naming the bad option.
        """
        check_task(name, handler, retry, max_attempts, batch_complete, timeout, group_commit)
        if name in self._tasks:
            raise InvalidArgumentError("name", f"task {name!r} is already registered")
        deadline = None if timeout is None else check_timeout("timeout", timeout)
        task: Task[P, R] = Task(
            name, handler, None, retry, max_attempts, batch_complete, deadline, group_commit,
            self.repository if repository is None else repository, queue, priority, self.middleware)
        self._tasks[name] = task
        return task

    @overload
    def task(self, name: Callable[Concatenate[JobContext, S, P], R]) -> Task[P, R]: ...
    @overload
    def task(self, name: Callable[Concatenate[S, JobContext, P], R]) -> Task[P, R]: ...
    @overload
    def task(self, name: Callable[Concatenate[JobContext, P], R]) -> Task[P, R]: ...
    @overload
    def task(self, name: Callable[Concatenate[S, P], R]) -> Task[P, R]: ...
    @overload
    def task(self, name: Callable[P, R]) -> Task[P, R]: ...
    @overload
    def task(
        self,
        name: str | None = None,
        *,
        retry: RetryPolicy = ...,
        max_attempts: int | None = ...,
        batch_complete: bool = ...,
        timeout: timedelta | float | None = ...,
        group_commit: bool = ...,
        repository: Any = ...,
        queue: str = ...,
        priority: int = ...,
    ) -> TaskDecorator: ...

    def task(
        self,
        name: str | Callable[..., Any] | None = None,
        *,
        retry: RetryPolicy = DEFAULT_RETRY_POLICY,
        max_attempts: int | None = None,
        batch_complete: bool = True,
        timeout: timedelta | float | None = None,
        group_commit: bool = False,
        repository: Any = None,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
    ) -> Task[..., Any] | TaskDecorator:
        """Decorator form of :meth:`register`; the name defaults to the
        function's. It returns the :class:`Task`: still callable as the
        function, and what its jobs are enqueued through."""
        if callable(name):
            return self.register(name.__name__, name)
        options: dict[str, Any] = {
            "retry": retry, "max_attempts": max_attempts, "batch_complete": batch_complete, "timeout": timeout,
            "group_commit": group_commit, "repository": repository, "queue": queue, "priority": priority,
        }
        return TaskDecorator(self, name, options)

    # -- periodic jobs (see sa_jobqueue/schedule.py, periodic.py, docs/periodic.md)

    def schedule(
        self,
        cron: str,
        task: str,
        *,
        payload: Any = None,
        queue: str = DEFAULT_QUEUE,
        catch_up: bool = False,
        name: str | None = None,
        priority: int = 0,
    ) -> Periodic:
        """Enqueue ``task`` at every tick of ``cron`` (UTC; 5 fields, or 6 with
        seconds last). ``name`` (default: the task's) tells the schedules of a
        queue apart, like a Celery beat entry's key. Raises
        :class:`InvalidArgumentError` naming the bad option."""
        check_cron("cron", cron)
        check_name("task", task)
        entry = Periodic(
            cron=cron, task=task, name=task if name is None else name, payload=payload, queue=queue,
            catch_up=catch_up, priority=priority,
        )
        if any(e.queue == entry.queue and e.name == entry.name for e in self._periodic):
            raise InvalidArgumentError(
                "name", f"a schedule {entry.name!r} on queue {entry.queue!r} exists; give this one another name"
            )
        self._periodic.append(entry)
        return entry

    def periodic(
        self,
        cron: str,
        *,
        payload: Any = None,
        queue: str = DEFAULT_QUEUE,
        catch_up: bool = False,
        name: str | None = None,
        priority: int = 0,
    ) -> Callable[[F], F]:
        """Decorator: a schedule for the task of the decorated handler, stacked
        with ``@registry.task`` (above or below it)::

            @tasks.periodic("*/5 * * * *", payload={"kind": "digest"})
            @tasks.task
            def send_digest(job, session): ...

        The expression is checked at once; the task is found by its handler.
        """
        options: dict[str, Any] = {
            "payload": payload, "queue": queue, "catch_up": catch_up, "name": name, "priority": priority,
        }
        check_cron("cron", cron)
        # Everything but the task name is checked now, not at the first tick.
        Periodic(
            cron=cron, task="-", name="-" if name is None else name, payload=payload, queue=queue,
            catch_up=catch_up, priority=priority,
        )

        def decorate(handler: F) -> F:
            if not callable(handler):
                raise InvalidArgumentError("handler", "must be callable")
            task = self._task_of(handler)
            if task is None:
                self._pending.append((handler, {"cron": cron, **options}))
            else:
                self.schedule(cron, task.name, **options)
            return handler

        return decorate

    @property
    def periodic_tasks(self) -> list[Periodic]:
        """The schedules, in registration order."""
        while self._pending:
            handler, options = self._pending[0]
            task = self._task_of(handler)
            if task is None:
                raise InvalidArgumentError(
                    "handler", f"{getattr(handler, '__name__', handler)!r} has a @periodic schedule but is "
                    "not a registered task; add @registry.task"
                )
            self._pending.pop(0)
            self.schedule(options.pop("cron"), task.name, **options)
        return list(self._periodic)

    def _task_of(self, handler: Handler) -> Task[..., Any] | None:
        if isinstance(handler, Task):
            return handler if self._tasks.get(handler.name) is handler else None
        return next((t for t in self._tasks.values() if t.handler is handler), None)

    def get(self, name: str) -> Task[..., Any] | None:
        return self._tasks.get(name) if isinstance(name, str) else None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._tasks

    def __iter__(self) -> Iterator[Task[..., Any]]:
        return iter(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)


class TaskDecorator:
    """``@registry.task(...)`` with options: registers the function it decorates and returns its :class:`Task`.

    Its overloads tell a type checker what :meth:`Task.enqueue` takes: the
    handler's parameters, less the leading ones the worker fills (a
    ``JobContext``, the session).
    """

    def __init__(self, registry: TaskRegistry, name: str | None, options: dict[str, Any]) -> None:
        self.registry = registry
        self.name = name
        self.options = options

    @overload
    def __call__(self, handler: Callable[Concatenate[JobContext, S, P], R]) -> Task[P, R]: ...
    @overload
    def __call__(self, handler: Callable[Concatenate[S, JobContext, P], R]) -> Task[P, R]: ...
    @overload
    def __call__(self, handler: Callable[Concatenate[JobContext, P], R]) -> Task[P, R]: ...
    @overload
    def __call__(self, handler: Callable[Concatenate[S, P], R]) -> Task[P, R]: ...
    @overload
    def __call__(self, handler: Callable[P, R]) -> Task[P, R]: ...

    def __call__(self, handler: Callable[..., Any]) -> Task[..., Any]:
        if not callable(handler):
            raise InvalidArgumentError("handler", "must be callable")
        name = getattr(handler, "__name__", None) if self.name is None else self.name
        return self.registry.register(name, handler, **self.options)  # type: ignore[arg-type]
