"""Deadlines: how long past its deadline a handler may run, and when to give up.

A Python thread cannot be killed. A handler still running a grace after its
deadline (its own timeout, at most :data:`STUCK_GRACE`) is given up on: its
slot thread is replaced, and counted; once more are stuck than
``max_stuck_slots``, the worker stops with :class:`WorkerStuckError` so that
the process supervisor starts a fresh process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import WorkerStuckError

if TYPE_CHECKING:
    from .books import Held
    from .context import WorkerContext
    from .slots import Slots

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
