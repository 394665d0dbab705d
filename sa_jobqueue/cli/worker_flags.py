"""What every command that runs a worker shares: ``sa-jobqueue worker`` and
``flask jobs worker`` take the same ``--shutdown-timeout`` and print the same
result line. Kept apart from the commands so that neither imports the other.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import click

from ..worker.books import WorkerResult
from .formatting import seconds

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT", "result_line", "shutdown_options", "shutdown_timeout_option"]

DEFAULT_SHUTDOWN_TIMEOUT = "30"  # seconds

shutdown_timeout_option = click.option(
    "--shutdown-timeout", default=DEFAULT_SHUTDOWN_TIMEOUT, show_default=True, metavar="SECONDS", callback=seconds(),
    help="How long SIGTERM waits for running jobs before the worker returns, leaving them to their lease; "
         "a second SIGTERM/SIGINT stops at once.",
)


def shutdown_options(ctx: click.Context, timeout: float) -> dict[str, Any]:
    """The :class:`Worker` keyword for ``--shutdown-timeout`` (``timeout`` seconds)."""
    return {"shutdown_timeout": timedelta(seconds=timeout)}


def result_line(result: WorkerResult) -> str:
    """A worker's result as the one JSON line the worker commands print."""
    return json.dumps(asdict(result))
