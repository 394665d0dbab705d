"""The event loop the command line runs the asyncio worker in: uvloop's when
it is installed (``pip install uvloop``), else asyncio's own."""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("sa_jobqueue.cli")

__all__ = ["event_loop_name", "run_in_event_loop"]


def event_loop_name() -> str:
    """``"uvloop"`` when uvloop can be imported, else ``"asyncio"``."""
    try:
        importlib.import_module("uvloop")
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_in_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end in a new event loop (uvloop's when installed)."""
    if event_loop_name() == "asyncio":
        return asyncio.run(main)
    uvloop: Any = importlib.import_module("uvloop")
    log.info("event loop: uvloop %s", getattr(uvloop, "__version__", ""))
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # pragma: no cover - Python 3.10
    return asyncio.run(main)  # pragma: no cover - Python 3.10
