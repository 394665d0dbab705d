"""Flask-SQLAlchemy 3.x integration: enqueue in the request, run jobs in the app context.

::

    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy
    from sa_jobqueue.contrib.flask import JobQueue

    db = SQLAlchemy()
    jobqueue = JobQueue()

    @jobqueue.tasks.task
    def send_welcome(user_id: int) -> None:
        user = db.session.get(User, user_id)  # db.session is the job's session here
        ...

    def create_app():
        app = Flask(__name__)
        app.config["SQLALCHEMY_DATABASE_URI"] = "postgresql+psycopg://app@db/app"
        db.init_app(app)
        jobqueue.init_app(app, db)
        return app

* ``send_welcome.enqueue(db.session, user_id)`` (the tasks of the default
  registry write into the first table), or :meth:`JobQueue.enqueue` by
  name, inserts the job on ``db.session``: it commits
  with the request's own writes when the view commits, and never when the
  request fails (Flask-SQLAlchemy removes the session, rolling it back, at
  the end of the app context).
* :meth:`JobQueue.worker` builds a :class:`~sa_jobqueue.Worker` on
  ``db.engine`` whose every job runs inside ``app.app_context()``, with
  ``db.session`` bound to the job's own session: the handler's writes commit
  with the job's completion, exactly once.
* ``flask jobs …``: the ``sa-jobqueue`` commands on the app's engine.

Only this module imports Flask; the core of sa_jobqueue never does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import click
from flask import Flask, current_app, has_app_context
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import Session

from ..cli.database import database_errors
from ..cli.errors import CliUsageError, OneLineGroup
from ..cli.state import CliState
from ..cli.worker_flags import freeze_startup, result_line, shutdown_options, shutdown_timeout_option
from ..default import Job
from ..errors import InvalidArgumentError, JobQueueError
from ..registry import TaskRegistry
from ..repository import JobRepository
from ..runnable import RunnableTask
from ..task import Handler
from ..worker.threaded import Worker

EXTENSION = "sa_jobqueue"

__all__ = ["EXTENSION", "JobQueue"]


@dataclass(frozen=True)
class _AppState:
    """What ``app.extensions["sa_jobqueue"]`` holds for one app."""

    jobqueue: JobQueue
    db: SQLAlchemy


class JobQueue:
    """The Flask extension: ``JobQueue(app, db)`` or ``JobQueue()`` then ``init_app(app, db)``.

    ``repositories``: the job tables (default: the default table,
    ``sa_jobqueue.default.Job``); the first one is the one :meth:`enqueue`
    and ``flask jobs`` use unless told otherwise. ``tasks``: the handlers
    (default: a new, empty :class:`TaskRegistry`, at :attr:`tasks`).
    """

    def __init__(
        self,
        app: Flask | None = None,
        db: SQLAlchemy | None = None,
        *,
        repositories: JobRepository[Any] | Sequence[JobRepository[Any]] | None = None,
        tasks: TaskRegistry | None = None,
    ) -> None:
        if repositories is None:
            repositories = JobRepository(Job)
        if isinstance(repositories, JobRepository):
            repositories = [repositories]
        self.repositories: list[JobRepository[Any]] = list(repositories)
        if not self.repositories or not all(isinstance(r, JobRepository) for r in self.repositories):
            raise InvalidArgumentError("repositories", "must be a JobRepository or a non-empty sequence of them")
        if tasks is None:
            tasks = TaskRegistry(repository=self.repositories[0])  # where its tasks' enqueue writes
        if not isinstance(tasks, TaskRegistry):
            raise InvalidArgumentError("tasks", "must be a TaskRegistry")
        self.tasks = tasks
        if app is not None:
            if db is None:
                raise InvalidArgumentError("db", "JobQueue(app, db): the app's SQLAlchemy extension is needed")
            self.init_app(app, db)

    @property
    def repository(self) -> JobRepository[Any]:
        """The first job table: the one :meth:`enqueue` uses by default."""
        return self.repositories[0]

    # -- setup -----------------------------------------------------------

    def init_app(self, app: Flask, db: SQLAlchemy) -> None:
        """Register on ``app``: ``app.extensions["sa_jobqueue"]`` and the ``flask jobs`` commands."""
        if not isinstance(db, SQLAlchemy):
            raise InvalidArgumentError("db", f"must be a flask_sqlalchemy.SQLAlchemy, got {type(db).__name__}")
        if "sqlalchemy" not in app.extensions:
            raise InvalidArgumentError("db", "call db.init_app(app) before jobqueue.init_app(app, db)")
        if EXTENSION in app.extensions:
            raise InvalidArgumentError("app", "sa_jobqueue is already initialised on this app")
        app.extensions[EXTENSION] = _AppState(self, db)
        app.cli.add_command(self._cli_group(app, db))

    def _state(self, app: Flask | None = None) -> tuple[Flask, SQLAlchemy]:
        if app is None:
            if not has_app_context():
                raise RuntimeError(
                    "no Flask app: call this in an app context (a request, app.app_context()) or pass app="
                )
            app = cast(Flask, current_app._get_current_object())  # type: ignore[attr-defined]
        state = app.extensions.get(EXTENSION)
        if not isinstance(state, _AppState) or state.jobqueue is not self:
            raise RuntimeError(f"this JobQueue is not initialised on the app {app.name!r}: call init_app(app, db)")
        return app, state.db

    # -- enqueue ---------------------------------------------------------

    def enqueue(
        self, task: str, payload: Any = None, *, repository: JobRepository[Any] | None = None, **options: Any
    ) -> Any:
        """Enqueue a job on ``db.session`` (the request's session) and return it.

        It commits when the view commits ``db.session``, with the request's
        own writes, or never. ``options`` are :meth:`JobRepository.enqueue`'s
        (``queue``, ``priority``, ``delay``, ``run_at``, ``max_attempts``,
        ``dedupe_key``, ``extra``). Needs an app context (a request, a CLI
        command, or a job run by :meth:`worker`, where ``db.session`` is the
        job's session).
        """
        _, db = self._state()
        return (repository or self.repository).enqueue(db.session(), task, payload, **options)

    # -- workers ---------------------------------------------------------

    def worker(self, app: Flask | None = None, **options: Any) -> Worker:
        """A :class:`Worker` on ``db.engine`` for this JobQueue's tables and tasks.

        Every job runs inside ``app.app_context()`` (``current_app``,
        ``app.config`` and ``g`` work in handlers) and ``db.session`` is the
        job's session there: its writes commit with the job's completion
        (never call ``db.session.commit()`` in a handler). ``options`` are
        :class:`Worker`'s (``queues``, ``concurrency``, ``mode``, ...).
        ``app`` defaults to the current app.
        """
        app, db = self._state(app)
        with app.app_context():
            engine = db.engine
        return Worker(engine, self.repositories, self.app_tasks(app), **options)

    def app_tasks(self, app: Flask | None = None) -> TaskRegistry:
        """A copy of :attr:`tasks` (schedules included) whose handlers run in ``app``'s context.

        Each wrapped handler takes the job's session, so every job's
        completion commits in the job's own transaction (no batching of
        session-less handlers' completions).
        """
        app, db = self._state(app)
        wrapped = TaskRegistry()
        for task in self.tasks:
            wrapped.register(
                task.name, _in_app_context(app, db, task), retry=task.retry, max_attempts=task.max_attempts,
                batch_complete=task.batch_complete, timeout=task.timeout, group_commit=task.group_commit,
            )
        for entry in self.tasks.periodic_tasks:
            wrapped.schedule(
                entry.cron, entry.task, payload=entry.payload, queue=entry.queue, catch_up=entry.catch_up,
                name=entry.name, priority=entry.priority,
            )
        return wrapped

    # -- flask jobs ------------------------------------------------------

    def _cli_group(self, app: Flask, db: SQLAlchemy) -> click.Group:
        jobqueue = self

        @click.group("jobs", cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
        @click.pass_context
        def group(ctx: click.Context) -> None:
            """Job queues on the app's database: workers, enqueueing, inspection, housekeeping."""
            ctx.with_resource(app.app_context())
            ctx.obj = CliState(None, engine=db.engine, repository=jobqueue.repository)

        from ..cli import main  # the whole command line, loaded when the app builds its commands

        for name, command in main.commands.items():
            if name != "worker":
                group.add_command(command)

        @group.command("worker")
        @click.option("--queue", "queues", multiple=True, metavar="NAME",
                      help="Queue to serve (repeatable, default: default).")
        @click.option("--concurrency", type=click.IntRange(1), default=4, show_default=True,
                      help="Jobs run at once (threads).")
        @click.option("--mode", type=click.Choice(["lease", "transaction"]), default="lease", show_default=True)
        @click.option("--listen/--no-listen", default=True, show_default=True,
                      help="Wake on LISTEN/NOTIFY, not only polls.")
        @click.option("--batch-size", type=int, default=None, help="Jobs per claim.")
        @click.option("--name", default=None, help="Worker name stored in locked_by (default host:pid:random).")
        @click.option("--until-empty", is_flag=True, help="Stop when no job is runnable (default: run until SIGTERM).")
        @shutdown_timeout_option
        @click.pass_context
        def worker(
            ctx: click.Context, queues: tuple[str, ...], concurrency: int, mode: str, listen: bool,
            batch_size: int | None, name: str | None, until_empty: bool, shutdown_timeout: float,
        ) -> None:
            """Run a worker for the app's tasks, each job in the app context, until SIGINT or SIGTERM."""
            try:
                built = jobqueue.worker(
                    app, queues=list(queues) or "default", concurrency=concurrency, mode=mode,
                    listen=listen, batch_size=batch_size, name=name, **shutdown_options(ctx, shutdown_timeout),
                )
            except JobQueueError as exc:
                raise CliUsageError(str(exc)) from None
            freeze_startup()
            with database_errors(db.engine, jobqueue.repository.table.name):
                result = built.run(until_empty=until_empty)
            click.echo(result_line(result))

        return group


def _in_app_context(app: Flask, db: SQLAlchemy, task: RunnableTask) -> Handler:
    """``task``'s handler, run in an app context of its own with ``db.session`` bound to the job's session."""

    def run_in_app_context(job: Any, session: Session) -> Any:
        with app.app_context():
            registry = db.session.registry
            registry.set(cast(Any, session))  # a plain Session, not Flask-SQLAlchemy's subclass
            try:
                return task.run(job, session)
            finally:
                # Unbound before the context ends: Flask-SQLAlchemy's teardown
                # would otherwise close the job's session before it commits.
                registry.clear()

    run_in_app_context.__name__ = getattr(task.handler, "__name__", task.name)
    run_in_app_context.__qualname__ = getattr(task.handler, "__qualname__", task.name)
    run_in_app_context.__doc__ = getattr(task.handler, "__doc__", None)
    return run_in_app_context
