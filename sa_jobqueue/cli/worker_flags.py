"""What every command that runs a worker shares: ``sa-jobqueue worker`` and
``flask jobs worker`` take the same ``--shutdown-timeout``, freeze what the
process built before the worker runs, and print the same result line. Kept
apart from the commands so that neither imports the other.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import click

from ..worker.books import WorkerResult
from .formatting import seconds

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT", "freeze_startup", "result_line", "shutdown_options", "shutdown_timeout_option"]

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


def freeze_startup() -> None:
    """Before a worker command runs its worker: collect the garbage of the start-up, then move
    every object left (the imported modules, the application, the engine) out of reach of
    Python's cyclic garbage collector (:func:`gc.freeze`). Every job leaves objects that outlive
    a few young collections (its snapshot, its place in the books); enough of them make Python
    run a full collection, which walks every object of the process while holding the GIL: about
    45 ms for a worker on the default table, eleven times in a drain of 150,000 short jobs
    (docs/benchmarks.md). Frozen, those objects are not walked again. They are still freed when
    no longer referenced; only a reference cycle among them would be kept, and the commands
    own their process, which a library's ``Worker.run()`` does not."""
    gc.collect()
    gc.freeze()
