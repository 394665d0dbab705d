"""Deadlines: how long past its deadline a handler may run, and when to give up.

A Python thread cannot be killed. A handler still running a grace after its
deadline (its own timeout, at most :data:`STUCK_GRACE`) is given up on: its
slot thread is replaced, and counted; once more are stuck than
``max_stuck_slots``, the worker stops with :class:`WorkerStuckError` so that
the process supervisor starts a fresh process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .. import signals
from ..errors import JobLostError, WorkerStuckError
from .failures import record_failure, timeout_failure

if TYPE_CHECKING:
    from .books import Held
    from .context import WorkerContext
    from .slots import Slots

log = logging.getLogger("sa_jobqueue.worker")

# How long a handler may keep running past its deadline (its failure already
# recorded) before its thread is given up on and replaced: its own timeout,
# at most this.
STUCK_GRACE = 5.0


def grace(held: Held) -> float:
    """How long past its deadline a handler may run before its thread is given up on."""
    assert held.deadline is not None and held.started is not None
    return min(STUCK_GRACE, held.deadline - held.started)


def check_stuck(ctx: WorkerContext, slots: Slots) -> None:
    """Raise :class:`WorkerStuckError` once more threads are stuck than ``max_stuck_slots``."""
    limit = ctx.options.max_stuck_slots
    if slots.stuck > limit:
        raise WorkerStuckError(
            f"worker {ctx.name}: {slots.stuck} threads are stuck in handlers past their deadline "
            f"(max_stuck_slots={limit}); stopping so that the process supervisor restarts the worker"
        )


def record_timeout(ctx: WorkerContext, held: Held) -> None:
    """Record that ``held`` (a started job with a deadline) timed out, in a
    transaction of the control; count and signal it. Both lease drivers call
    it once they stopped extending the job's lease. A job that finished or was
    reaped meanwhile is left as it is; a failing write is logged (the lease expires)."""
    job = held.job
    task = ctx.tasks.get(job.task)
    assert task is not None and held.started is not None and held.deadline is not None
    seconds = held.deadline - held.started
    log.error("worker %s: job %s (%s) timed out after %g s", ctx.name, job.id, job.task, seconds)
    try:
        with ctx.control() as session:
            outcome = record_failure(session, held.repo, job, timeout_failure(task, seconds))
    except JobLostError:
        return  # it finished (or was reaped) meanwhile
    except Exception:
        log.exception("worker %s: recording the timeout of job %s failed; its lease will expire", ctx.name, job.id)
        return
    ctx.books.count(outcome)
    ctx.books.tally(job, "failed")
    signals.send_failure(ctx.sender, job, None, outcome, seconds)
