"""``enqueue`` a job, and the read-only ``jobs list`` and ``jobs show``."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import click
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..dedupe import Dedupe, HeldUntil, OnConflict
from ..progress import Progress
from ..states import STATUSES
from .database import database_errors
from .errors import CliError, CliUsageError, OneLineCommand, OneLineGroup
from .formatting import render_table, short, when
from .state import cli_state, model_option, repository_for
from .typed import typed_job

__all__ = ["enqueue_command", "jobs_group"]


@click.command("enqueue", cls=OneLineCommand)
@click.argument("task")
@click.option("--payload", default=None, metavar="JSON",
              help="The job's payload as JSON (default: {}; null is stored as {} too).")
@click.option("--arg", "args", multiple=True, metavar="NAME=TEXT|NAME:=JSON",
              help="An argument of a typed task (needs --tasks), as text or as JSON. Repeatable.")
@click.option("--tasks", "tasks_path", default=None, metavar="MODULE:ATTR",
              help="The TaskRegistry that has TASK: its arguments are checked against the handler, and its "
                   "job table, queue and priority are the defaults.")
@click.option("--queue", default="default", show_default=True)
@click.option("--priority", type=int, default=0, show_default=True, help="Lower runs first (-32768 … 32767).")
@click.option("--delay", type=float, default=None, metavar="SECONDS", help="Run no earlier than this from now.")
@click.option("--max-attempts", type=int, default=None,
              help="Attempts before the job is dead (default: the task's max_attempts, else 20).")
@click.option("--dedupe-key", default=None, help="Skip the insert while a live job of the queue holds this key.")
@click.option("--on-conflict", type=click.Choice(["skip", "replace", "debounce"]), default="skip", show_default=True,
              help="With --dedupe-key, when a pending job holds the key: leave it (skip), give it this job's payload "
                   "and run time (replace), or move its run time to this job's when later (debounce).")
@click.option("--key-held-until", "until", type=click.Choice(["finished", "started"]), default="finished",
              show_default=True, help="With --dedupe-key: the job holds the key until it finishes, or until it starts.")
@click.option("--dedupe-window", "window", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS", help="With --dedupe-key, on a table that keeps finished jobs: a job of the key that "
                                      "finished done and was enqueued less than this ago holds the key too.")
@model_option
@click.pass_context
def enqueue_command(
    ctx: click.Context, task: str, payload: str | None, args: tuple[str, ...], tasks_path: str | None, queue: str,
    priority: int, delay: float | None, max_attempts: int | None, dedupe_key: str | None, on_conflict: OnConflict,
    until: HeldUntil, window: float | None, model_path: str,
) -> None:
    """Enqueue one job of TASK and print its id."""
    # No --payload, or a JSON null, is the library's payload=None: stored as {}.
    value: Any = None
    if payload is not None:
        if args:
            raise CliUsageError("--payload and --arg: give one of them")
        try:
            value = json.loads(payload)
        except ValueError as exc:
            raise CliUsageError(f"--payload: not valid JSON: {exc}") from None
    given = {name for name in ("queue", "priority", "model_path")
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}
    if tasks_path is None:
        if args:
            raise CliUsageError("--arg needs --tasks MODULE:ATTR, the registry whose handler the arguments fit")
        repository = repository_for(ctx, model_path)
    else:
        typed = typed_job(tasks_path, task, args, value, queue=queue if "queue" in given else None,
                          priority=priority if "priority" in given else None)
        value, queue, priority = typed.payload, typed.queue, typed.priority
        bound = None if "model_path" in given else typed.repository
        repository = bound if bound is not None else repository_for(ctx, model_path)
    dedupe: Dedupe | None = None
    if dedupe_key is not None:
        dedupe = Dedupe(dedupe_key, on_conflict=on_conflict, until=until,
                        window=None if window is None else timedelta(seconds=window))
    elif any(ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
             for name in ("on_conflict", "until", "window")):
        raise CliUsageError("--on-conflict, --key-held-until and --dedupe-window need --dedupe-key")
    engine = cli_state(ctx).engine()
    with database_errors(engine, repository.table.name), Session(engine) as session, session.begin():
        job = repository.enqueue(
            session, task, value, queue=queue, priority=priority, delay=delay, dedupe_key=dedupe,
            max_attempts=max_attempts,
        )
        job_id = job.id
    click.echo(job_id)


@click.group("jobs", cls=OneLineGroup)
def jobs_group() -> None:
    """Look at jobs (read-only)."""


@jobs_group.command("list")
@click.option("--queue", default=None)
@click.option("--status", "statuses", multiple=True, type=click.Choice(STATUSES), help="Repeatable.")
@click.option("--task", default=None)
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@model_option
@click.pass_context
def jobs_list(
    ctx: click.Context, queue: str | None, statuses: tuple[str, ...], task: str | None, limit: int, model_path: str
) -> None:
    """Jobs, newest first."""
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    t = repository.table
    stmt = select(t.c.id, t.c.queue, t.c.task, t.c.status, t.c.priority, t.c.attempts, t.c.run_at, t.c.last_error)
    if queue is not None:
        stmt = stmt.where(t.c.queue == queue)
    if statuses:
        stmt = stmt.where(t.c.status.in_(statuses))
    if task is not None:
        stmt = stmt.where(t.c.task == task)
    stmt = stmt.order_by(t.c.id.desc()).limit(limit)
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        rows = session.execute(stmt).all()
    if not rows:
        click.echo("no jobs")
        return
    click.echo(render_table(
        ["id", "queue", "task", "status", "priority", "attempts", "run_at", "last_error"],
        [(r.id, r.queue, r.task, r.status, r.priority, r.attempts, when(r.run_at), short(r.last_error, 40))
         for r in rows],
    ))


@jobs_group.command("show")
@click.argument("job_id", type=int, metavar="ID")
@model_option
@click.pass_context
def jobs_show(ctx: click.Context, job_id: int, model_path: str) -> None:
    """Every column of one job; the payload as JSON."""
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    t = repository.table
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        row = session.execute(select(t).where(t.c.id == job_id)).mappings().first()
    if row is None:
        raise CliError(f"job {job_id} not found in {t.name}")
    width = max(len(key) for key in row)
    for key, value in row.items():
        if key == "payload":
            shown = json.dumps(value, ensure_ascii=False)
        elif key == "progress" and (progress := Progress.from_json(value)) is not None:
            shown = f"{progress.fraction:.0%} {progress.message}".rstrip()
        elif isinstance(value, datetime):
            shown = value.isoformat()
        else:
            shown = "-" if value is None else str(value)
        click.echo(f"{key.ljust(width)}  {shown}")
