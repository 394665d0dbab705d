"""RetryPolicy: when a failed job runs again.

The delay before attempt ``n + 1`` is ``base * factor ** (n - 1)``, capped
at ``max_delay``, then spread by ``± jitter`` (a fraction) so that jobs that
failed together do not all come back in the same instant.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta

from .errors import InvalidArgumentError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter. The defaults suit remote calls:
    15 s, 30 s, 1 min, 2 min … capped at one day."""

    base: timedelta = timedelta(seconds=15)
    factor: float = 2.0
    max_delay: timedelta = timedelta(days=1)
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.base < timedelta(0):
            raise InvalidArgumentError("base", "must not be negative")
        if self.factor < 1:
            raise InvalidArgumentError("factor", "must be at least 1")
        if self.max_delay < self.base:
            raise InvalidArgumentError("max_delay", "must be at least base")
        if not 0 <= self.jitter < 1:
            raise InvalidArgumentError("jitter", "must be in [0, 1)")

    def delay(self, attempt: int) -> timedelta:
        """The wait after failed attempt number ``attempt`` (1 for the first)."""
        exponent = max(attempt - 1, 0)
        seconds = self.base.total_seconds()
        cap = self.max_delay.total_seconds()
        # Compare in log space first so a large attempt count cannot overflow.
        raw = cap if exponent > 64 else min(cap, seconds * self.factor**exponent)
        spread = raw * self.jitter
        return timedelta(seconds=max(0.0, raw + random.uniform(-spread, spread)))


DEFAULT_RETRY_POLICY = RetryPolicy()
