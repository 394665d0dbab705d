"""``queues`` and ``workers``: pause and resume a queue; which workers are alive.

::

    sa-jobqueue queues pause newsletters --by "mail provider down"
    sa-jobqueue queues list
    sa-jobqueue queues resume newsletters
    sa-jobqueue workers

Both read and write the operations tables of revision 0007
(``sa_jobqueue_paused_queues``, ``sa_jobqueue_workers``); a database
without them gets one line saying so.
"""

from __future__ import annotations

from datetime import datetime

import click
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..control_tables import PAUSED, PAUSED_TABLE, WORKERS_TABLE
from ..pausing import pause_queue, resume_queue
from ..presence import WorkerPresence, list_workers
from ..progress import Progress
from .database import database_errors
from .errors import OneLineCommand, OneLineGroup
from .formatting import format_age, render_table, when
from .state import cli_state, model_option, repository_for

__all__ = ["describe_running", "queues_group", "workers_command"]


@click.group("queues", cls=OneLineGroup)
def queues_group() -> None:
    """Pause, resume and list paused queues (workers stop claiming within one poll interval)."""


@queues_group.command("pause", cls=OneLineCommand)
@click.argument("queue")
@click.option("--by", default=None, metavar="TEXT", help="Who paused it, or why (shown by the dashboard).")
@model_option
@click.pass_context
def queues_pause(ctx: click.Context, queue: str, by: str | None, model_path: str) -> None:
    """Stop workers claiming from QUEUE; pending jobs stay pending, running ones finish."""
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    with database_errors(engine, PAUSED_TABLE), Session(engine) as session, session.begin():
        changed = pause_queue(session, repository, queue, by=by)
    click.echo(f"paused {queue} of {repository.table.name}" if changed
               else f"{queue} of {repository.table.name} was already paused")


@queues_group.command("resume", cls=OneLineCommand)
@click.argument("queue")
@model_option
@click.pass_context
def queues_resume(ctx: click.Context, queue: str, model_path: str) -> None:
    """Let workers claim from QUEUE again."""
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    with database_errors(engine, PAUSED_TABLE), Session(engine) as session, session.begin():
        changed = resume_queue(session, repository, queue)
    click.echo(f"resumed {queue} of {repository.table.name}" if changed
               else f"{queue} of {repository.table.name} was not paused")


@queues_group.command("list", cls=OneLineCommand)
@click.pass_context
def queues_list(ctx: click.Context) -> None:
    """The paused queues of every job table, with when and by whom."""
    engine = cli_state(ctx).engine()
    with database_errors(engine, PAUSED_TABLE), Session(engine) as session, session.begin():
        rows = session.execute(
            select(PAUSED.c.job_table, PAUSED.c.queue, func.now() - PAUSED.c.paused_at, PAUSED.c.paused_by)
            .order_by(PAUSED.c.job_table, PAUSED.c.queue)
        ).all()
    if not rows:
        click.echo("no queue is paused")
        return
    click.echo(render_table(["table", "queue", "paused for", "by"],
                            [(r[0], r[1], format_age(r[2]), r[3]) for r in rows]))


@click.command("workers", cls=OneLineCommand)
@click.option("--running", "show_running", is_flag=True, help="List each worker's running jobs too.")
@click.pass_context
def workers_command(ctx: click.Context, show_running: bool) -> None:
    """The worker processes, alive first: what they serve, their last beat, how many jobs they run."""
    engine = cli_state(ctx).engine()
    with database_errors(engine, WORKERS_TABLE), Session(engine) as session, session.begin():
        found = list_workers(session)
        now = session.execute(select(func.now())).scalar_one()
    if not found:
        click.echo("no worker has announced itself")
        return
    click.echo(render_table(
        ["name", "state", "host", "pid", "driver", "mode", "concurrency", "tables", "queues", "running",
         "last beat", "up"],
        [(w.name, "alive" if w.alive else "gone", w.host, w.pid, w.driver, w.mode, w.concurrency,
          ",".join(w.tables), ",".join(w.queues), len(w.running), format_age(now - w.beat_at) + " ago",
          format_age(now - w.started_at)) for w in found],
    ))
    if show_running:
        for worker in found:
            for line in describe_running(worker, now):
                click.echo(f"  {worker.name}: {line}")


def describe_running(worker: WorkerPresence, now: datetime) -> list[str]:
    """One line per running job of ``worker``: table, id, task, for how long, its progress."""
    lines = []
    for job in worker.running:
        progress = Progress.from_json(job.get("progress"))
        since = datetime.fromisoformat(job["since"])
        shown = "" if progress is None else f", {progress.fraction:.0%} {progress.message}".rstrip()
        lines.append(f"{job['table']} job {job['id']} ({job['task']}, queue {job['queue']}, attempt "
                     f"{job['attempt']}) since {when(since)} ({format_age(now - since)}){shown}")
    return lines
