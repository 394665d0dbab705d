"""``stats`` and ``health``: what a job table holds, and whether it is served."""

from __future__ import annotations

from datetime import timedelta

import click
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from ..control_tables import WORKERS_TABLE
from ..presence import list_workers
from ..states import PENDING, STATUSES
from .database import database_errors, show_url
from .errors import CliError, OneLineCommand
from .formatting import format_age, render_table, seconds, when
from .state import cli_state, model_option, repository_for

__all__ = ["DEFAULT_MAX_RUNNABLE_AGE", "connection_budget", "health_command", "stats_command"]

# Five minutes: well past a crashed worker's recovery (lease 60 s + reap every 30 s by default),
# so only a queue nobody takes jobs from, or far too few workers, trips it.
DEFAULT_MAX_RUNNABLE_AGE = "300"  # seconds


@click.command("stats", cls=OneLineCommand)
@model_option
@click.pass_context
def stats_command(ctx: click.Context, model_path: str) -> None:
    """Jobs per queue and status, with the age of the oldest runnable job."""
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    with database_errors(engine, repository.table.name), Session(engine) as session, session.begin():
        rows = repository.stats(session)
    if not rows:
        click.echo(f"no jobs in {repository.table.name}")
        return
    click.echo(render_table(
        ["queue", "status", "count", "oldest runnable"],
        [(r.queue, r.status, r.count, format_age(r.oldest_runnable_age) if r.status == PENDING else "") for r in rows],
    ))


def connection_budget(processes: int, concurrency: int) -> tuple[int, int]:
    """(at most, in steady state) connections of ``processes`` thread workers of
    ``concurrency`` each: P × (2C + 5) and P × (C + 5) (docs/operations.md)."""
    return processes * (2 * concurrency + 5), processes * (concurrency + 5)


@click.command("health", cls=OneLineCommand)
@click.option(
    "--max-runnable-age", default=DEFAULT_MAX_RUNNABLE_AGE, show_default=True, metavar="SECONDS|off",
    callback=seconds(positive=True, off_word="off"),
    help="Fail when the oldest runnable pending job has waited longer than this (off: never).",
)
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="Each worker process's concurrency: show the deployment's connection budget, and fail when "
                   "it cannot fit in max_connections.")
@click.option("--processes", type=click.IntRange(min=1), default=None,
              help="Worker processes of the deployment, for the budget (with --concurrency; default 1).")
@click.option("--min-workers", type=click.IntRange(min=1), default=None,
              help="Fail when fewer live worker processes than this serve the table (their presence rows).")
@model_option
@click.pass_context
def health_command(
    ctx: click.Context, max_runnable_age: float | None, concurrency: int | None, processes: int | None,
    min_workers: int | None, model_path: str,
) -> None:
    """Check the database, the job table, and that runnable jobs get taken; exit non-zero when not."""
    if processes is not None and concurrency is None:
        raise click.UsageError("--processes needs --concurrency: the budget is processes x (2 x concurrency + 5)")
    repository = repository_for(ctx, model_path)
    engine = cli_state(ctx).engine()
    t = repository.table
    schema: str | None = t.schema
    qualified = f"{schema}.{t.name}" if schema else t.name
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        server = session.execute(text("SHOW server_version")).scalar_one()
        oid = session.execute(
            text("SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                 "WHERE c.relname = :name AND n.nspname = coalesce(:schema, current_schema())"),
            {"name": t.name, "schema": schema},
        ).scalar_one_or_none()
        if oid is None:
            raise CliError(f"table {qualified!r} does not exist in {show_url(engine.url)}")
        counts: dict[str, int] = {
            str(status): int(n) for status, n in session.execute(select(t.c.status, func.count()).group_by(t.c.status))
        }
        oldest: timedelta | None = session.execute(
            select(func.max(func.now() - t.c.run_at)).where(t.c.status == PENDING, t.c.run_at <= func.now())
        ).scalar_one()
        dead_tuples = session.execute(
            text("SELECT n_dead_tup, n_live_tup, last_autovacuum FROM pg_stat_user_tables WHERE relid = :oid"),
            {"oid": oid},
        ).first()
        xmin_age = session.execute(
            text("SELECT max(age(backend_xmin)) FROM pg_stat_activity WHERE pid <> pg_backend_pid()")
        ).scalar_one()
        # Client sessions only: autovacuum and the server's own processes do
        # not count against max_connections. This one is counted too.
        connections = session.execute(text(
            "SELECT count(*) FILTER (WHERE datname = current_database()) AS here, count(*) AS server, "
            "current_setting('max_connections')::int AS most, "
            "current_setting('superuser_reserved_connections')::int AS reserved "
            "FROM pg_stat_activity WHERE backend_type = 'client backend'"
        )).one()
    click.echo(f"database          ok ({show_url(engine.url)}, PostgreSQL {server})")
    click.echo(f"table             {qualified}")
    click.echo("jobs              " + ", ".join(f"{s} {counts.get(s, 0)}" for s in STATUSES))
    click.echo(f"oldest runnable   {format_age(oldest)}")
    if dead_tuples is not None:
        click.echo(f"dead tuples       {dead_tuples.n_dead_tup} (live {dead_tuples.n_live_tup}, "
                   f"last autovacuum {when(dead_tuples.last_autovacuum)})")
    click.echo("oldest xmin age   " + ("- (no transaction holds back vacuum)" if xmin_age is None
                                      else f"{xmin_age} transactions"))
    usable = connections.most - connections.reserved
    click.echo(f"connections       {connections.here} to this database, {connections.server} to the server, "
               f"of max_connections {connections.most} ({connections.reserved} reserved for superusers)")
    if concurrency is not None:
        processes = processes or 1
        peak, steady = connection_budget(processes, concurrency)
        click.echo(f"worker budget     {peak} at most = {processes} x (2 x {concurrency} + 5), {steady} in steady "
                   f"state, of {usable} usable")
        if peak > usable:
            raise CliError(
                f"the connection budget of {processes} worker process(es) of concurrency {concurrency}, {peak}, "
                f"exceeds the {usable} connections the server allows (max_connections {connections.most} less "
                f"{connections.reserved} reserved): lower --concurrency, or put PgBouncer in front"
            )
    with database_errors(engine, WORKERS_TABLE):
        serving = _live_workers(engine, t.name)
    click.echo("workers           " + ("- (no sa_jobqueue_workers table: revision 0007)" if serving is None
                                      else f"{serving} alive serving {t.name}"))
    if min_workers is not None and (serving or 0) < min_workers:
        raise CliError(f"{serving or 0} live worker process(es) serve {qualified}, fewer than --min-workers "
                       f"{min_workers}")
    limit = None if max_runnable_age is None else timedelta(seconds=max_runnable_age)
    if limit is not None and oldest is not None and oldest > limit:
        raise CliError(
            f"the oldest runnable job in {qualified} has waited {format_age(oldest)}, longer than "
            f"--max-runnable-age {max_runnable_age:g}s: no worker is taking its jobs, or too few are"
        )


def _live_workers(engine: Engine, table: str) -> int | None:
    """How many live workers serve ``table``; None when the presence table does not exist."""
    with Session(engine) as session, session.begin():
        if session.execute(text("SELECT to_regclass(:name)"), {"name": WORKERS_TABLE}).scalar_one() is None:
            return None
        return sum(1 for worker in list_workers(session, tables=[table]) if worker.alive)
