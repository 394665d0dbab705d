"""``sa-jobqueue worker MODULE:ATTR``: run a worker until SIGINT or SIGTERM.

What ``flask jobs worker`` shares with it is in :mod:`.worker_flags`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, cast

import click
from sqlalchemy import Engine, literal, select

from ..errors import JobQueueError, WorkerStuckError
from ..registry import TaskRegistry
from ..worker.threaded import Worker
from .database import CONNECT_TIMEOUT, database_errors, make_engine
from .errors import CliError, CliUsageError, OneLineCommand, first_line
from .event_loop import run_in_event_loop
from .formatting import seconds
from .state import cli_state, import_object, model_option, repository_for
from .supervisor import Supervisor
from .worker_flags import freeze_startup, result_line, shutdown_options, shutdown_timeout_option

__all__ = ["worker_command"]

log = logging.getLogger("sa_jobqueue.cli")

# The options a worker factory must not be given (it configures its worker itself).
WORKER_OPTIONS = {
    "queues": "--queue", "concurrency": "--concurrency", "mode": "--mode", "listen": "--listen/--no-listen",
    "batch_size": "--batch-size", "model_path": "--model", "name": "--name", "shutdown_timeout": "--shutdown-timeout",
    "job_timeout": "--job-timeout",
}

@click.command("worker", cls=OneLineCommand)
@click.argument("import_path", metavar="MODULE:ATTR")
@click.option("--queue", "queues", multiple=True, metavar="NAME", help="Queue to serve (repeatable, default: default).")
@click.option("--concurrency", type=int, default=4, show_default=True,
              help="Jobs run at once: threads, or with async def handlers, jobs in flight.")
@click.option("--mode", type=click.Choice(["lease", "transaction"]), default="lease", show_default=True)
@click.option("--listen/--no-listen", default=True, show_default=True, help="Wake on LISTEN/NOTIFY, not only polls.")
@click.option("--batch-size", type=int, default=None, help="Jobs per claim.")
@click.option("--name", default=None, help="Worker name stored in locked_by (default host:pid:random).")
@shutdown_timeout_option
@click.option("--job-timeout", default=None, metavar="SECONDS", callback=seconds(positive=True),
              help="Deadline of the jobs whose task sets none (default: none).")
@click.option("--processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Worker processes, run and restarted by a supervisor (this command).")
@model_option
@click.pass_context
def worker_command(
    ctx: click.Context, import_path: str, queues: tuple[str, ...], concurrency: int, mode: str, listen: bool,
    batch_size: int | None, name: str | None, shutdown_timeout: float, job_timeout: float | None, model_path: str,
    processes: int,
) -> None:
    """Run a worker until SIGINT or SIGTERM.

    MODULE:ATTR names either a TaskRegistry, run with the options given here
    on the database URL, or a zero-argument factory returning a configured
    Worker or AsyncWorker (the factory builds its own engine; the worker
    options here are then refused). A registry with async def handlers runs
    in the asyncio worker, on uvloop when it is installed. With --processes N
    this command supervises N worker processes, each running it with the
    same options (see docs/operations.md).
    """
    target = import_object(import_path, "IMPORT_PATH")  # a bad path fails here, before any process starts
    if processes > 1:
        raise SystemExit(Supervisor(lambda n: _worker_process_command(name, n), processes).run())
    if isinstance(target, TaskRegistry):
        _run_registry(ctx, target, queues=queues, concurrency=concurrency, mode=mode, listen=listen,
                      batch_size=batch_size, name=name, shutdown_timeout=shutdown_timeout, job_timeout=job_timeout,
                      model_path=model_path)
    elif callable(target) and not isinstance(target, type):
        given = [
            flag for param, flag in WORKER_OPTIONS.items()
            if ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise CliUsageError(
                f"{import_path} is a worker factory: it configures the worker itself, so "
                f"{', '.join(given)} cannot be given"
            )
        try:
            built = target()
        except Exception as exc:  # the factory is user code: report it in one line
            raise CliError(f"{import_path}() failed: {type(exc).__name__}: {first_line(exc)}") from None
        if not isinstance(built, Worker) and not _is_async_worker(built):
            raise CliUsageError(f"{import_path}() returned {type(built).__name__}, not a Worker or an AsyncWorker")
        _run(built)
    else:
        raise CliUsageError(
            f"IMPORT_PATH: {import_path} is a {type(target).__name__}; name a TaskRegistry "
            "or a zero-argument function returning a Worker"
        )


def _worker_process_command(name: str | None, number: int) -> list[str]:
    """This command line, run as the ``number``-th worker process: a later
    option wins in click; a name given is the process's with ``-number``."""
    named = [] if name is None else ["--name", f"{name}-{number}"]
    return [sys.executable, "-m", "sa_jobqueue.cli", *sys.argv[1:], "--processes", "1", *named]


def _run_registry(
    ctx: click.Context, registry: TaskRegistry, *, queues: tuple[str, ...], concurrency: int, mode: str,
    listen: bool, batch_size: int | None, name: str | None, shutdown_timeout: float, job_timeout: float | None,
    model_path: str,
) -> None:
    repository = repository_for(ctx, model_path)
    if concurrency < 1:
        raise CliUsageError(f"--concurrency: must be 1 or more, got {concurrency}")
    # A connection per slot, plus the control, claim and listener ones.
    engine = make_engine(cli_state(ctx).database_url, pool_size=concurrency + 4, max_overflow=4)
    try:
        with database_errors(engine, repository.table.name):
            with engine.connect() as conn:  # fail fast, in one line, when the server is unreachable
                conn.execute(select(literal(1)).select_from(repository.table).limit(1)).all()
            if any(task.is_async for task in registry):
                _run_async_registry(engine, repository, registry, queues=list(queues) or "default",
                                    concurrency=concurrency, mode=mode, listen=listen, batch_size=batch_size,
                                    name=name,
                                    job_timeout=job_timeout, **shutdown_options(ctx, shutdown_timeout))
                return
            try:
                built = Worker(
                    engine, repository, registry, queues=list(queues) or "default", concurrency=concurrency,
                    mode=cast(Literal["lease", "transaction"], mode), listen=listen, batch_size=batch_size,
                    name=name, job_timeout=job_timeout, **shutdown_options(ctx, shutdown_timeout),
                )
            except JobQueueError as exc:
                raise CliUsageError(str(exc)) from None
            _run(built)
    finally:
        engine.dispose()


def _run(built: Any) -> None:
    """Run a Worker, or an AsyncWorker in an event loop of its own; print its result line."""
    log.info("worker %s serving %s in %s mode", built.name, ", ".join(built.queues), built.mode)
    freeze_startup()
    try:
        result = built.run() if isinstance(built, Worker) else run_in_event_loop(built.run())
    except WorkerStuckError as exc:  # exit non-zero, so that the supervisor starts a fresh process
        raise CliError(str(exc)) from None
    click.echo(result_line(result))


def _is_async_worker(value: object) -> bool:
    # Looked up, not imported: a factory that made an AsyncWorker imported it already.
    module = sys.modules.get("sa_jobqueue.aio.worker")
    return module is not None and isinstance(value, module.AsyncWorker)


def _run_async_registry(engine: Engine, repository: Any, registry: TaskRegistry, **options: Any) -> None:
    """The asyncio worker on an async engine of the same URL (psycopg's async
    driver unless the URL names asyncpg), the sync engine for sync handlers."""
    from sqlalchemy.ext.asyncio import create_async_engine  # only here: the sync CLI never imports asyncio support

    from ..aio import AsyncWorker

    connect_args = {"connect_timeout": CONNECT_TIMEOUT} if engine.url.get_driver_name() == "psycopg" else {}
    # Async handlers that take a session hold one each while they run: the
    # worker lets at most this many do so at once (its max_sessions).
    async_engine = create_async_engine(engine.url, connect_args=connect_args,
                                       pool_size=min(options["concurrency"], 20), max_overflow=0)
    try:
        built = AsyncWorker(async_engine, repository, registry, sync_bind=engine, **options)
    except JobQueueError as exc:
        raise CliUsageError(str(exc)) from None
    try:
        _run(built)
    finally:
        run_in_event_loop(async_engine.dispose())
