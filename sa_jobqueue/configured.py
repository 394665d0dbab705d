"""A task with the options of the jobs it enqueues: ``task.configure(...)``.

::

    send_welcome.enqueue(session, user.id)                       # the task's defaults
    send_welcome.configure(queue="signup", delay=60).enqueue(session, user.id)

The options belong to the job (queue, priority, run_at or delay,
max_attempts, dedupe_key, extra, meta, the job table); the arguments belong to
the handler. They are given in two calls, so no handler parameter name can
clash with an option: ``enqueue``'s own only parameter is the session,
positional-only, and every other argument of the call is the handler's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

from .arguments import Parameters, is_async_session_type
from .dedupe import Dedupe
from .errors import InvalidArgumentError
from .spec import JobSpec, to_row

__all__ = ["ConfiguredTask", "JobOptions"]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class JobOptions:
    """The options of a job enqueued through a task; None leaves an option to the task's default."""

    queue: str | None = None
    priority: int | None = None
    run_at: datetime | None = None
    delay: timedelta | float | None = None
    max_attempts: int | None = None
    dedupe_key: str | Dedupe | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    repository: Any = None
    meta: Mapping[str, Any] | None = None

    def merged(self, later: JobOptions) -> JobOptions:
        """These options with ``later``'s given ones over them (``extra`` merged key by key; a given
        ``meta`` replaces the earlier one)."""
        given = {name: getattr(later, name) for name in self.__dataclass_fields__ if name != "extra"
                 if getattr(later, name) is not None}
        return replace(self, **given, extra={**self.extra, **later.extra})


class Enqueued(Protocol):
    """What a configured task needs of its :class:`~sa_jobqueue.Task`."""

    @property
    def name(self) -> str: ...
    @property
    def parameters(self) -> Parameters: ...
    @property
    def repository(self) -> Any: ...
    @property
    def queue(self) -> str: ...
    @property
    def priority(self) -> int: ...


@dataclass(frozen=True)
class ConfiguredTask(Generic[P, R]):
    """``task`` (a :class:`~sa_jobqueue.Task`) with job options: enqueue through it as through the task."""

    task: Enqueued
    options: JobOptions

    def __post_init__(self) -> None:
        # Checked now, so that a bad option fails where it is written, not at the first enqueue.
        spec = self._spec({})
        to_row(spec, frozenset(spec.extra))
        if self.options.repository is not None:
            check_repository(self.options.repository)

    def configure(self, **options: Any) -> ConfiguredTask[P, R]:
        """The same, with ``options`` (those of :meth:`Task.configure`) over these."""
        configured: ConfiguredTask[P, R] = ConfiguredTask(self.task, self.options.merged(JobOptions(**options)))
        return configured

    def enqueue(self, session: Any, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Bind ``args`` and ``kwargs`` to the handler's parameters and insert
        the job in ``session``'s transaction (the caller commits); return it.
        A bad argument raises :class:`~sa_jobqueue.InvalidArgumentError`
        naming it, before anything is sent."""
        return _insert(self._repository(), session, self.spec(*args, **kwargs))

    async def enqueue_async(self, session: Any, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """:meth:`enqueue` on an ``AsyncSession``."""
        async_session = _check_async_session(session)
        spec = self.spec(*args, **kwargs)
        repository = self._repository()
        return await async_session.run_sync(lambda s: _insert(repository, s, spec))

    def spec(self, *args: P.args, **kwargs: P.kwargs) -> JobSpec:
        """The job as a :class:`~sa_jobqueue.JobSpec`, for ``enqueue_many`` (one statement for many jobs)."""
        return self._spec(self.task.parameters.bind(self.task.name, args, kwargs))

    def _spec(self, payload: dict[str, Any]) -> JobSpec:
        o = self.options
        return JobSpec(
            task=self.task.name, payload=payload, queue=o.queue if o.queue is not None else self.task.queue,
            priority=o.priority if o.priority is not None else self.task.priority, run_at=o.run_at, delay=o.delay,
            max_attempts=o.max_attempts, dedupe_key=o.dedupe_key, extra=o.extra, meta=o.meta)

    def _repository(self) -> Any:
        repository = self.options.repository if self.options.repository is not None else self.task.repository
        if repository is None:
            raise InvalidArgumentError(
                "repository", f"task {self.task.name!r} has no job table to enqueue into: give it one with "
                "@tasks.task(repository=...), TaskRegistry(repository=...) or .configure(repository=...)")
        return check_repository(repository)


def _insert(repository: Any, session: Any, spec: JobSpec) -> Any:
    return repository.enqueue(
        session, spec.task, spec.payload, queue=spec.queue, priority=spec.priority, run_at=spec.run_at,
        delay=spec.delay, max_attempts=spec.max_attempts, dedupe_key=spec.dedupe_key, extra=dict(spec.extra),
        meta=spec.meta)


def check_repository(value: object) -> Any:
    """A task's ``repository``: a JobRepository, or an AsyncJobRepository (its sync twin is used).

    Told by its type's name and verbs, not by import: the task module stays
    below the repository's in the package's layers (docs/architecture.md)."""
    sync = getattr(value, "sync", value)  # an AsyncJobRepository runs its JobRepository's verbs
    named = any(c.__name__ == "JobRepository" for c in type(sync).__mro__)
    if not (named and callable(getattr(sync, "enqueue", None))):
        raise InvalidArgumentError(
            "repository", f"must be a JobRepository (or an AsyncJobRepository), got {type(value).__name__}")
    return sync


def _check_async_session(value: object) -> Any:
    """``enqueue_async``'s session: an ``AsyncSession`` (or an ``async_scoped_session`` proxying one),
    told by name: the core never imports SQLAlchemy's asyncio extension."""
    if type(value).__name__ == "async_scoped_session" and callable(value):
        value = value()
    if not is_async_session_type(type(value)):
        raise InvalidArgumentError(
            "session", f"must be a sqlalchemy.ext.asyncio.AsyncSession, got {type(value).__name__} "
            "(a Session takes enqueue)")
    return value
