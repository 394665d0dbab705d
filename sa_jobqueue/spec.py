"""JobSpec: one job to enqueue, checked before anything is sent.

:meth:`JobRepository.enqueue` builds one; :meth:`JobRepository.enqueue_many`
takes many. Every check raises :class:`InvalidArgumentError` naming the
parameter, before any statement runs, so bad input writes nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .errors import InvalidArgumentError
from .mixin import (
    DEDUPE_KEY_LENGTH,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    NAME_LENGTH,
    PRIORITY_MAX,
    PRIORITY_MIN,
)

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class JobSpec:
    """What to enqueue. ``payload`` must be JSON (no NaN or infinity).

    ``priority``: lower runs first (-32768 … 32767, default 0).
    ``run_at`` (aware datetime) or ``delay`` (timedelta or seconds): when the
    job becomes runnable; default now. ``dedupe_key``: while a live (pending or
    running) job of the same queue holds this key, enqueueing returns that job
    instead of a new one. ``extra``: values for the model's own columns.
    """

    task: str
    payload: Any = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    run_at: datetime | None = None
    delay: timedelta | float | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    dedupe_key: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def _name(parameter: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentError(parameter, f"must be a string, got {type(value).__name__}")
    if not value or not value.strip():
        raise InvalidArgumentError(parameter, "must not be empty")
    if len(value) > limit:
        raise InvalidArgumentError(parameter, f"must be at most {limit} characters, got {len(value)}")
    return value


def _int(parameter: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(parameter, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidArgumentError(parameter, f"must be between {low} and {high}, got {value}")
    return value


def positive_int(parameter: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 1 (not a bool); raise naming ``parameter``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(parameter, f"must be a positive integer, got {value!r}")
    return value


def check_payload(payload: Any) -> Any:
    """Return the payload if it is strict JSON; raise naming ``payload`` otherwise."""
    try:
        json.dumps(payload, allow_nan=False)
    except ValueError as exc:  # NaN or infinity, or a circular reference
        raise InvalidArgumentError("payload", f"is not valid JSON: {exc}") from None
    except TypeError as exc:
        raise InvalidArgumentError("payload", f"is not JSON serializable: {exc}") from None
    return payload


def check_delay(parameter: str, value: timedelta | float | None) -> timedelta:
    if value is None:
        return timedelta(0)
    if isinstance(value, bool):
        raise InvalidArgumentError(parameter, "must be a timedelta or a number of seconds")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise InvalidArgumentError(parameter, f"must be finite, got {value}")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise InvalidArgumentError(parameter, "must be a timedelta or a number of seconds")
    if value < timedelta(0):
        raise InvalidArgumentError(parameter, f"must not be negative, got {value}")
    return value


def check_aware(parameter: str, value: datetime | None) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidArgumentError(parameter, f"must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgumentError(
            parameter, "must be timezone-aware (a naive datetime has no defined instant)"
        )
    return value


def to_row(spec: JobSpec, user_columns: frozenset[str]) -> dict[str, Any]:
    """Check ``spec`` and return the INSERT parameters for it."""
    if not isinstance(spec, JobSpec):
        raise InvalidArgumentError("jobs", f"items must be JobSpec, got {type(spec).__name__}")
    if spec.run_at is not None and spec.delay is not None:
        raise InvalidArgumentError("run_at", "give run_at or delay, not both")
    dedupe_key = spec.dedupe_key
    if dedupe_key is not None:
        dedupe_key = _name("dedupe_key", dedupe_key, DEDUPE_KEY_LENGTH)
    row: dict[str, Any] = {
        "task": _name("task", spec.task, NAME_LENGTH),
        "queue": _name("queue", spec.queue, NAME_LENGTH),
        "payload": check_payload({} if spec.payload is None else spec.payload),
        "priority": _int("priority", spec.priority, PRIORITY_MIN, PRIORITY_MAX),
        "max_attempts": _int("max_attempts", spec.max_attempts, 1, _INT32_MAX),
        "dedupe_key": dedupe_key,
        "run_at": check_aware("run_at", spec.run_at),
        "delay": check_delay("delay", spec.delay),
    }
    if not isinstance(spec.extra, Mapping):
        raise InvalidArgumentError("extra", "must be a mapping of column name to value")
    unknown = set(spec.extra) - user_columns
    if unknown:
        raise InvalidArgumentError(
            "extra",
            f"unknown column(s) {sorted(unknown)}; extra sets the model's own columns "
            f"({sorted(user_columns) or 'none'})",
        )
    row.update(spec.extra)
    return row
