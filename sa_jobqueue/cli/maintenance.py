"""Housekeeping: ``retry``, ``cancel``, ``purge`` and ``reap``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import click
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from ..repository import JobRepository
from ..spec import FINISHED_STATUSES
from ..states import DEAD, RUNNING
from .database import database_errors
from .errors import CliError, CliUsageError, OneLineCommand
from .formatting import parse_duration
from .state import cli_state, model_option, repository_for

__all__ = ["PURGE_BATCH", "REAP_BATCH", "cancel_command", "purge_command", "reap_command", "retry_command"]

PURGE_BATCH = 1000
REAP_BATCH = 1000


def _change_each(
    engine: Engine, repository: JobRepository[Any], ids: Sequence[int],
    verb: Callable[[Session, int], bool], wanted: str,
) -> int:
    """Apply ``verb`` to every id in one transaction; on any refusal, roll back and raise one line."""
    t = repository.table
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        problems: list[str] = []
        for job_id in dict.fromkeys(ids):
            if verb(session, job_id):
                continue
            status = session.execute(select(t.c.status).where(t.c.id == job_id)).scalar_one_or_none()
            problems.append(f"job {job_id} " + ("not found" if status is None else f"is {status}, not {wanted}"))
        if problems:
            session.rollback()
            raise CliError("; ".join(problems) + " (nothing changed)")
    return len(dict.fromkeys(ids))


@click.command("retry", cls=OneLineCommand)
@click.argument("job_ids", type=int, nargs=-1, metavar="[ID]...")
@click.option("--all-dead", is_flag=True, help="Retry every dead job (of --queue / --task when given).")
@click.option("--queue", default=None)
@click.option("--task", default=None)
@model_option
@click.pass_context
def retry_command(
    ctx: click.Context, job_ids: tuple[int, ...], all_dead: bool, queue: str | None, task: str | None,
    model_path: str,
) -> None:
    """Send dead (or cancelled) jobs back to pending now."""
    if bool(job_ids) == all_dead:
        raise CliUsageError("give job ids or --all-dead (one of the two)")
    if job_ids and (queue is not None or task is not None):
        raise CliUsageError("--queue and --task go with --all-dead only")
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    if job_ids:
        count = _change_each(engine, repository, job_ids, repository.retry, "dead or cancelled (or its dedupe key "
                             "is held by a live job)")
        click.echo(f"retried {count} job(s)")
        return
    t = repository.table
    stmt = select(t.c.id).where(t.c.status == DEAD).order_by(t.c.id)
    if queue is not None:
        stmt = stmt.where(t.c.queue == queue)
    if task is not None:
        stmt = stmt.where(t.c.task == task)
    retried = skipped = 0
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        for job_id in session.scalars(stmt).all():
            if repository.retry(session, job_id):
                retried += 1
            else:
                skipped += 1
    click.echo(f"retried {retried} dead job(s)" + (f", skipped {skipped} (dedupe key held)" if skipped else ""))


@click.command("cancel", cls=OneLineCommand)
@click.argument("job_ids", type=int, nargs=-1, required=True, metavar="ID...")
@model_option
@click.pass_context
def cancel_command(ctx: click.Context, job_ids: tuple[int, ...], model_path: str) -> None:
    """Cancel pending jobs; request the cancel of running ones (all or none)."""
    repository = repository_for(ctx, model_path)
    t = repository.table
    requested: set[int] = set()

    def cancel(session: Session, job_id: int) -> bool:
        if not repository.cancel(session, job_id):
            return False
        # cancel() is True for both: a running job stays running, its cancel requested.
        if session.execute(select(t.c.status).where(t.c.id == job_id)).scalar_one() == RUNNING:
            requested.add(job_id)
        return True

    count = _change_each(cli_state(ctx).engine(), repository, job_ids, cancel, "pending or running")
    said = [f"cancelled {count - len(requested)} job(s)"] if count > len(requested) else []
    if requested:
        said.append(f"cancel requested for {len(requested)} running job(s)")
    click.echo(", ".join(said))


@click.command("purge", cls=OneLineCommand)
@click.option("--older-than", "older_than_text", required=True, metavar="DURATION",
              help="Finished longer ago than this: 7d, 12h, 30m, 45s, 1h30m.")
@click.option("--status", "statuses", multiple=True, type=click.Choice(FINISHED_STATUSES),
              help="Repeatable (default: done, dead, cancelled).")
@click.option("--batch-size", type=click.IntRange(1, 100_000), default=PURGE_BATCH, show_default=True,
              help="Rows deleted per transaction.")
@model_option
@click.pass_context
def purge_command(
    ctx: click.Context, older_than_text: str, statuses: tuple[str, ...], batch_size: int, model_path: str
) -> None:
    """Delete finished jobs, in batches of their own transaction each."""
    try:
        older_than = parse_duration(older_than_text)
    except ValueError as exc:
        raise CliUsageError(f"--older-than: {exc}") from None
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    chosen = list(statuses) or list(FINISHED_STATUSES)
    t = repository.table
    count_stmt = select(func.count()).select_from(t).where(
        t.c.status.in_(chosen), t.c.finished_at < func.now() - older_than
    )
    total = 0
    with database_errors(engine, t.name):
        with Session(engine) as session, session.begin():
            expected = int(session.execute(count_stmt).scalar_one())
        # A progress bar on a terminal; logs and pipes get the final line only.
        bar = click.progressbar(length=expected, label=f"purging {t.name}", file=sys.stderr)
        with bar if sys.stderr.isatty() else nullcontext(bar):
            while True:
                with Session(engine) as session, session.begin():
                    deleted = repository.purge(session, statuses=chosen, older_than=older_than, limit=batch_size)
                total += deleted
                if sys.stderr.isatty():
                    bar.update(deleted)
                if deleted == 0:
                    break
    click.echo(f"purged {total} job(s)")


@click.command("reap", cls=OneLineCommand)
@model_option
@click.pass_context
def reap_command(ctx: click.Context, model_path: str) -> None:
    """Send running jobs whose lease expired back to pending (or to dead)."""
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    requeued = dead = 0
    with database_errors(engine, repository.table.name):
        while True:
            with Session(engine) as session, session.begin():
                result = repository.reap(session, limit=REAP_BATCH)
            requeued += result.requeued
            dead += result.dead
            if result.requeued + result.dead < REAP_BATCH:
                break
    click.echo(f"requeued {requeued}, dead {dead}")
