"""Enqueue hooks: what an integration adds to every enqueue in the process.

::

    @contextmanager
    def traced(enqueueing: Enqueueing) -> Iterator[None]:
        with tracer.start_as_current_span(f"send {enqueueing.queues[0]}"):
            enqueueing.meta["trace"] = current_trace_context()  # written into each job's meta
            yield                                               # the rows are written here
            # enqueueing.jobs: the jobs as written (ids known)

    add_enqueue_hook(traced)

An enqueue hook is a callable that takes the :class:`Enqueueing` of one
``enqueue`` or ``enqueue_many`` call, after its arguments are checked and
before its statements run, and returns a context manager the writing runs
in. What it puts in :attr:`Enqueueing.meta` is merged into the ``meta`` of
every job of the call (keys the caller gave in ``meta`` win). The rows are
written in the caller's transaction, as always: a hook sees the statements
succeed or raise, not the commit. An exception a hook raises is the
enqueue's, and nothing of that call is written.

Hooks are the process's (``sa_jobqueue.contrib.opentelemetry`` registers
one): an enqueue checks one module global when none is registered, so the
cost of the enqueue path without hooks is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["EnqueueHook", "Enqueueing", "add_enqueue_hook", "enqueue_hooks", "remove_enqueue_hook"]

@dataclass
class Enqueueing:
    """One ``enqueue`` or ``enqueue_many`` call (or one statement's worth of it), as enqueue hooks see it."""

    #: The job table's name.
    table: str
    #: Each job's queue, in the order written.
    queues: list[str]
    #: Each job's task, in the same order.
    tasks: list[str]
    #: What the hooks add to the meta of every job of the call (a JSON object).
    meta: dict[str, Any] = field(default_factory=dict)
    #: The jobs as written (detached snapshots), once the statements have run; a job
    #: whose dedupe key a live job held is that job, with its own meta.
    jobs: list[Any] = field(default_factory=list)


EnqueueHook = Callable[[Enqueueing], AbstractContextManager[Any]]
"""An enqueue hook: called with the :class:`Enqueueing`, returns the context manager the writing runs in."""

#: The registered hooks, in order; replaced (never changed in place), so a reader needs no lock.
HOOKS: tuple[EnqueueHook, ...] = ()


def add_enqueue_hook(hook: EnqueueHook) -> EnqueueHook:
    """Register ``hook`` for every enqueue of the process (once: adding it again does nothing); return it."""
    global HOOKS
    if not callable(hook):
        raise InvalidArgumentError("hook", f"must be a callable returning a context manager, got {type(hook).__name__}")
    if hook not in HOOKS:
        HOOKS = (*HOOKS, hook)
    return hook


def remove_enqueue_hook(hook: EnqueueHook) -> None:
    """Unregister ``hook``; nothing when it is not registered."""
    global HOOKS
    HOOKS = tuple(h for h in HOOKS if h != hook)


def enqueue_hooks() -> tuple[EnqueueHook, ...]:
    """The registered hooks, in order."""
    return HOOKS
