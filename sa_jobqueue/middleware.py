"""Middleware: an ordered chain of context managers around every handler call.

::

    @contextmanager
    def timed(call: HandlerCall) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield                      # the handler runs here
        finally:
            log.info("%s took %.3f s", call.task, time.monotonic() - started)

    tasks = TaskRegistry(middleware=[timed])

A middleware is a callable that takes the :class:`HandlerCall` and returns a
context manager (a ``@contextmanager`` function is one), or, around an
``async def`` handler (``call.is_async``), an async context manager (an
``@asynccontextmanager`` function), which may await, say on the job's
``AsyncSession``. A middleware that serves both kinds of handler returns the
kind ``call.is_async`` asks for; an async one around a sync handler is that
attempt's failure, with a message that says so. The worker enters
the chain in order (the first is outermost), runs the handler inside it,
and leaves it in reverse order: a middleware sees the job before, and after
it the outcome: the handler's return value in ``call.result``, or the
exception that leaves the ``with`` (which it may let pass, replace, or
swallow). The same chain wraps sync handlers (in their thread) and
``async def`` handlers (around the awaited coroutine, in its task, so that
a context variable set on entry is seen by the handler).

What a caller may rely on: the chain runs where the handler runs, inside the
job's transaction when the handler asks for its session (``call.session``),
and before the worker's fenced completion, which no middleware reaches:
the handler's writes and any a middleware makes on ``call.session`` commit
once, with the completion, or roll back with the failure. A middleware must
not commit or roll back that session, as a handler must not. An exception a
middleware raises is the attempt's failure, as a handler's is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager, AsyncExitStack, ExitStack
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgumentError
from .job_context import JobContext

__all__ = ["HandlerCall", "Middleware", "call_through", "call_through_async", "check_middleware"]


@dataclass
class HandlerCall:
    """One call of a handler, as middleware sees it."""

    #: The task's name.
    task: str
    #: The running attempt (its id, attempt, queue, and the claimed row as ``context.job``).
    context: JobContext
    #: The job's session when the handler asks for one (its writes commit with the job), else None.
    session: Any
    #: Whether the handler is an ``async def`` (the chain may then hold async context managers).
    is_async: bool = False
    #: What the handler returned, once it has returned (None before).
    result: Any = field(default=None)


Middleware = Callable[[HandlerCall], AbstractContextManager[Any] | AbstractAsyncContextManager[Any]]
"""A middleware: called with the :class:`HandlerCall`, returns the context manager the handler runs in."""


def check_middleware(value: object) -> list[Middleware]:
    """A registry's ``middleware``: a sequence of callables; raise naming ``middleware``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidArgumentError("middleware", f"must be a list of callables, got {type(value).__name__}")
    for item in value:
        if not callable(item):
            raise InvalidArgumentError("middleware", f"items must be callables returning a context manager, "
                                       f"got {type(item).__name__}")
    return list(value)


def call_through(chain: Sequence[Middleware], call: HandlerCall, invoke: Callable[[], Any]) -> Any:
    """Run ``invoke`` (the handler) inside ``chain``; return its result."""
    with ExitStack() as stack:
        for middleware in chain:
            manager = middleware(call)
            if not _is_sync(manager):
                raise TypeError(f"middleware {_name(middleware)} returned {type(manager).__name__} around the sync "
                                f"handler of {call.task!r}: a sync handler runs in a context manager "
                                "(@contextmanager); return one when call.is_async is False")
            stack.enter_context(manager)  # type: ignore[arg-type]
        call.result = invoke()
        return call.result


async def call_through_async(chain: Sequence[Middleware], call: HandlerCall,
                             invoke: Callable[[], Awaitable[Any]]) -> Any:
    """Await ``invoke()`` (an ``async def`` handler) inside ``chain``; return its result."""
    async with AsyncExitStack() as stack:
        for middleware in chain:
            manager = middleware(call)
            if _is_sync(manager):
                stack.enter_context(manager)  # type: ignore[arg-type]
            elif hasattr(manager, "__aenter__") and hasattr(manager, "__aexit__"):
                await stack.enter_async_context(manager)  # type: ignore[arg-type]
            else:
                raise TypeError(f"middleware {_name(middleware)} returned {type(manager).__name__}, not a context "
                                "manager (decorate it with @contextmanager or @asynccontextmanager)")
        call.result = await invoke()
        return call.result


def _is_sync(manager: object) -> bool:
    return hasattr(manager, "__enter__") and hasattr(manager, "__exit__")


def _name(middleware: Middleware) -> str:
    return repr(getattr(middleware, "__name__", middleware))
