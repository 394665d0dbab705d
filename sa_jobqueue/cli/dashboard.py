"""``dashboard``: serve the web dashboard (the ``dashboard`` extra) with uvicorn."""

from __future__ import annotations

import click
from sqlalchemy.orm import Session

from .database import database_errors
from .errors import CliUsageError, OneLineCommand
from .state import DEFAULT_MODEL, cli_state, load_repository

__all__ = ["dashboard_command"]


@click.command("dashboard", cls=OneLineCommand)
@click.option("--model", "model_paths", multiple=True, metavar="MODULE:CLASS",
              help=f"A job model to show (repeatable; default: {DEFAULT_MODEL}).")
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--fd", type=click.IntRange(min=0), default=None,
              help="Serve on this inherited, bound socket instead of --host/--port (socket activation, tests).")
@click.option("--listen/--no-listen", default=True, show_default=True,
              help="Live updates from LISTEN/NOTIFY; --no-listen polls only (behind PgBouncer in transaction mode).")
@click.option("--poll-interval", type=click.FloatRange(min=0.1), default=5.0, show_default=True, metavar="SECONDS",
              help="Pages refresh at least this often.")
@click.option("--title", default="sa_jobqueue", show_default=True)
@click.option("--read-only", is_flag=True, help="Offer no action (retry, cancel, delete, run now, priority).")
@click.pass_context
def dashboard_command(
    ctx: click.Context, model_paths: tuple[str, ...], host: str, port: int, fd: int | None, listen: bool,
    poll_interval: float, title: str, read_only: bool,
) -> None:
    """Serve the dashboard of the job tables until interrupted."""
    try:
        import uvicorn

        from ..dashboard import create_app
    except ImportError as exc:
        raise CliUsageError(f"the dashboard needs its extra: pip install 'sa_jobqueue[dashboard]' ({exc})") from None
    repositories = [load_repository(path) for path in (model_paths or (DEFAULT_MODEL,))]
    engine = cli_state(ctx).engine()
    for repository in repositories:  # a missing table or database is one line now, not a broken page later
        with database_errors(engine, repository.table.name), Session(engine) as session:
            repository.stats(session)
    app = create_app(engine, repositories, title=title, listen=listen, poll_interval=poll_interval,
                     read_only=read_only)
    if fd is not None:
        uvicorn.run(app, fd=fd, log_level="warning")
    else:
        click.echo(f"dashboard on http://{host}:{port}/", err=True)
        uvicorn.run(app, host=host, port=port, log_level="warning")
