"""SIGINT and SIGTERM for the asyncio worker, through the event loop.

:meth:`asyncio.loop.add_signal_handler` runs the callback in the loop, as
any other callback, so a stop request takes no lock a signal could
interrupt (the thread worker needs a pipe and a thread of its own for
that: :mod:`sa_jobqueue.worker.shutdown`). The first signal asks for a
graceful stop, the next for an immediate one (the worker decides).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable

__all__ = ["install_signal_handlers"]


def install_signal_handlers(loop: asyncio.AbstractEventLoop, on_signal: Callable[[str], None]) -> Callable[[], None]:
    """Call ``on_signal(name)`` in ``loop`` on SIGINT and SIGTERM; return the undo,
    which puts back the handlers there were. Only the main thread may: elsewhere nothing is done."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        loop.add_signal_handler(sig, on_signal, sig.name)

    def restore() -> None:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)

    return restore
