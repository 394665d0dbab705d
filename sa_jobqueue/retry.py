"""RetryPolicy: when a failed job runs again.

The delay before attempt ``n + 1`` is ``base * factor ** (n - 1)``, capped
at ``max_delay``, then spread by ``± jitter`` (a fraction) so that jobs that
failed together do not all come back in the same instant.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import timedelta

from .errors import InvalidArgumentError
from .states import SCHEDULE_HORIZON


def _real(parameter: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(parameter, f"must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgumentError(parameter, f"must be finite, got {value}")
    return float(value)


def _duration(parameter: str, value: object) -> timedelta:
    if not isinstance(value, timedelta):
        raise InvalidArgumentError(parameter, f"must be a timedelta, got {type(value).__name__}")
    if value < timedelta(0):
        raise InvalidArgumentError(parameter, "must not be negative")
    if value > SCHEDULE_HORIZON:
        # The database adds the delay to now(); beyond this the retry time
        # could not be read back as a Python datetime.
        raise InvalidArgumentError(parameter, f"must be at most {SCHEDULE_HORIZON.days} days (100 years)")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter. The defaults suit remote calls:
    15 s, 30 s, 1 min, 2 min … capped at one day.

    ``base`` and ``max_delay`` are timedeltas from zero to 100 years,
    ``factor`` a finite number of at least 1, ``jitter`` a fraction in
    [0, 1); anything else raises :class:`InvalidArgumentError` naming it, so
    a policy can always compute a delay the database accepts.
    """

    base: timedelta = timedelta(seconds=15)
    factor: float = 2.0
    max_delay: timedelta = timedelta(days=1)
    jitter: float = 0.1

    def __post_init__(self) -> None:
        _duration("base", self.base)
        if _real("factor", self.factor) < 1:
            raise InvalidArgumentError("factor", "must be at least 1")
        if _duration("max_delay", self.max_delay) < self.base:
            raise InvalidArgumentError("max_delay", "must be at least base")
        if not 0 <= _real("jitter", self.jitter) < 1:
            raise InvalidArgumentError("jitter", "must be in [0, 1)")

    def delay(self, attempt: int) -> timedelta:
        """The wait after failed attempt number ``attempt`` (1 for the first)."""
        exponent = max(attempt - 1, 0)
        seconds = self.base.total_seconds()
        cap = self.max_delay.total_seconds()
        # Compare in log space: factor ** exponent overflows a float long
        # before the attempts run out (1e10 ** 31 does).
        if seconds <= 0:
            raw = 0.0
        elif exponent * math.log(self.factor) >= math.log(cap / seconds):
            raw = cap
        else:
            raw = min(cap, seconds * self.factor**exponent)
        spread = raw * self.jitter
        return timedelta(seconds=max(0.0, raw + random.uniform(-spread, spread)))


DEFAULT_RETRY_POLICY = RetryPolicy()


def check_policy(value: object) -> RetryPolicy:
    """``fail(policy=…)``: a RetryPolicy."""
    if not isinstance(value, RetryPolicy):
        raise InvalidArgumentError("policy", f"must be a RetryPolicy, got {type(value).__name__}")
    return value
