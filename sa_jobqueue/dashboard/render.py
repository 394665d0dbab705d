"""The dashboard's templates: one Jinja2 environment, with the filters its pages use.

Templates autoescape everything (a payload, an error or a task name is text,
never markup). The filters turn the queue's values into what a page shows:
``age`` (a timedelta), ``ago`` and ``instant`` (an aware datetime, in UTC),
``minute``, ``size`` (bytes) and ``pretty`` (a JSON value, indented).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape

from ..durations import clock_parts


def age(value: timedelta | None) -> str:
    """``1h 02m``, ``3m 05s``, ``12s``, ``0.4s``; an em dash for None."""
    if value is None:
        return "—"
    seconds = value.total_seconds()
    if seconds < 10:
        return f"{seconds:.1f}s"
    days, hours, minutes, secs = clock_parts(value)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def ago(value: datetime | None) -> str:
    """How long before now ``value`` was: ``3m 05s ago``; ``never`` for None."""
    return "never" if value is None else f"{age(datetime.now(timezone.utc) - value)} ago"


def instant(value: datetime | None) -> str:
    """``2026-12-02 21:45:37 UTC``; empty for None."""
    return "" if value is None else value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def minute(value: datetime | None) -> str:
    """``21:45 UTC``; empty for None."""
    return "" if value is None else value.astimezone(timezone.utc).strftime("%H:%M UTC")


def size(value: int) -> str:
    """Bytes as ``8.0 kB``, ``1.2 MB``…"""
    number = float(value)
    for unit in ("B", "kB", "MB", "GB"):
        if number < 1024 or unit == "GB":
            return f"{number:.0f} {unit}" if unit == "B" else f"{number:.1f} {unit}"
        number /= 1024
    return f"{number:.1f} TB"  # pragma: no cover - the loop returns at GB


def pretty(value: Any) -> str:
    """A JSON value, indented, keys in order."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def environment() -> Environment:
    """A Jinja2 environment over the package's templates, with the filters above."""
    env = Environment(loader=PackageLoader("sa_jobqueue.dashboard", "templates"),
                      autoescape=select_autoescape(default=True), trim_blocks=True, lstrip_blocks=True)
    env.filters.update(age=age, ago=ago, instant=instant, minute=minute, size=size, pretty=pretty)
    return env


__all__ = ["age", "ago", "environment", "instant", "minute", "pretty", "size"]
