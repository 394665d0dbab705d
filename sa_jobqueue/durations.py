"""Durations in the words people read them in: days, hours, minutes and seconds. Plain values."""

from __future__ import annotations

from datetime import timedelta


def clock_parts(value: timedelta) -> tuple[int, int, int, int]:
    """``value``'s whole days, hours, minutes and seconds (negative durations count as zero)."""
    seconds = max(0, int(value.total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return days, hours, minutes, secs


__all__ = ["clock_parts"]
