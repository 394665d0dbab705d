"""The ``sa-jobqueue`` command line: run workers, enqueue, inspect and tidy job tables.

::

    export DATABASE_URL=postgresql://app@db/app
    sa-jobqueue worker myapp.jobs:tasks --queue signup --concurrency 8
    sa-jobqueue enqueue send_welcome --payload '{"user_id": 42}' --queue signup
    sa-jobqueue stats
    sa-jobqueue jobs list --status dead
    sa-jobqueue retry --all-dead
    sa-jobqueue purge --older-than 7d
    sa-jobqueue health
    sa-jobqueue queues pause newsletters
    sa-jobqueue workers

The database URL comes from ``--database-url`` or ``DATABASE_URL``. Every
command runs in transactions of its own and commits them. Mistakes (a bad
URL, an unreachable server, a missing table, a bad import path, an argument
the library refuses, an unknown job id, click's own usage errors) end with
one ``Error: …`` line on stderr and a non-zero exit code; URLs are shown
with their password hidden.

The modules, one idea each: :mod:`.errors` (the one-line errors and the
command classes that keep usage errors to one line), :mod:`.database` (the
engine and database errors), :mod:`.state` (what the commands share),
:mod:`.formatting`, and the commands: :mod:`.worker`, :mod:`.jobs`
(``enqueue``, ``jobs list``, ``jobs show``), :mod:`.maintenance`
(``retry``, ``cancel``, ``purge``, ``reap``), :mod:`.health`
(``stats``, ``health``) and :mod:`.operations` (``queues``, ``workers``).

The core library never imports this package (nor click).
"""

from __future__ import annotations

import logging

import click

from .dashboard import dashboard_command
from .database import database_errors, make_engine, show_url
from .errors import CliError, CliUsageError, OneLineCommand, OneLineGroup, OneLineUsageError
from .formatting import format_age, parse_duration
from .health import health_command, stats_command
from .jobs import enqueue_command, jobs_group
from .maintenance import cancel_command, purge_command, reap_command, retry_command
from .operations import queues_group, workers_command
from .state import CliState, cli_state, repository_for
from .worker import worker_command
from .worker_flags import result_line, shutdown_options, shutdown_timeout_option

__all__ = [
    "CliError", "CliState", "CliUsageError", "OneLineCommand", "OneLineGroup", "OneLineUsageError", "cli_state",
    "database_errors", "format_age", "main", "make_engine", "parse_duration", "repository_for", "result_line",
    "show_url", "shutdown_options", "shutdown_timeout_option",
]


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--database-url", envvar="DATABASE_URL", metavar="URL",
    help="postgresql://user:password@host:port/db (default: $DATABASE_URL).",
)
@click.option(
    "--log-level", default="INFO", show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.version_option(package_name="sa_jobqueue")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, log_level: str) -> None:
    """Job queues on PostgreSQL tables: workers, enqueueing, inspection, housekeeping."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = CliState(database_url)
    ctx.obj = state
    ctx.call_on_close(state.close)


for _command in (
    worker_command, enqueue_command, stats_command, jobs_group,
    retry_command, cancel_command, purge_command, reap_command, health_command, dashboard_command, queues_group,
    workers_command,
):
    main.add_command(_command)
