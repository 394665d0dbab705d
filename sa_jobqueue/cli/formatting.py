"""What the commands read and print: durations, ages, tables, seconds options."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

import click

from ..durations import clock_parts
from ..spec import SCHEDULE_HORIZON

__all__ = ["format_age", "parse_duration", "render_table", "seconds", "short", "when"]


def format_age(age: timedelta | None) -> str:
    """``3d04h05m06s``, shortest form; ``-`` for None."""
    if age is None:
        return "-"
    days, hours, minutes, secs = clock_parts(age)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m{secs:02d}s"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


_DURATION_PART = re.compile(r"(\d+)\s*([wdhms])")
_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(value: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` or sums such as ``1h30m``; raise ValueError."""
    compact = value.strip().lower()
    parts = _DURATION_PART.findall(compact)
    if not compact or _DURATION_PART.sub("", compact).strip():
        raise ValueError(f"{value!r} is not a duration such as 7d, 12h, 30m, 45s or 1h30m")
    return timedelta(seconds=sum(int(n) * _UNITS[unit] for n, unit in parts))


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, a rule under the headers; None shows as ``-``."""
    cells = [[str(h) for h in headers], *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def when(value: datetime | None) -> str:
    """An instant to the second, ISO 8601; ``-`` for None."""
    return "-" if value is None else value.isoformat(timespec="seconds")


def short(value: object, limit: int = 60) -> str:
    """``value`` on one line, cut to ``limit`` characters with an ellipsis."""
    text_value = "-" if value is None else str(value).replace("\n", " ")
    return text_value if len(text_value) <= limit else text_value[: limit - 1] + "…"


def seconds(*, positive: bool = False, off_word: str | None = None) -> Callable[..., float | None]:
    """An option callback reading a number of seconds: zero or more (above zero with
    ``positive``), at most the library's ``SCHEDULE_HORIZON`` (100 years); with ``off_word``,
    that word gives None (turned off). A bad value is click's one-line usage error, naming
    the option."""

    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
        if value is None:
            return None
        if off_word is not None and value.strip().lower() == off_word:
            return None
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        too_long = not number <= SCHEDULE_HORIZON.total_seconds()  # NaN included
        if too_long or number < 0 or (positive and number == 0):
            wanted = "a number of seconds " + ("above 0" if positive else "from 0") + " up to 100 years"
            if off_word is not None:
                wanted += f", or {off_word}"
            raise click.BadParameter(f"{value!r} is not {wanted}.", ctx, param)
        return number

    return convert
