"""A schedule: a cron expression, and the job each of its ticks enqueues.

:class:`Periodic` is what ``TaskRegistry.schedule`` and ``@registry.periodic``
record; :class:`~sa_jobqueue.periodic.PeriodicScheduler` enqueues its due
ticks exactly once (see :mod:`sa_jobqueue.periodic` and docs/periodic.md).
Everything here is checked at once and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from croniter import croniter  # type: ignore[import-untyped]

from .checks import check_bool, check_name, int_between
from .errors import InvalidArgumentError
from .payloads import check_payload
from .states import DEFAULT_QUEUE, PRIORITY_MAX, PRIORITY_MIN

# A periodic job's dedupe key: "periodic:<schedule name>@<tick, ISO 8601>".
_DEDUPE_PREFIX = "periodic:"
_DEDUPE_SEPARATOR = "@"


def check_cron(parameter: str, value: object) -> str:
    """A cron expression croniter accepts: 5 fields (minute … day of week), 6
    (the sixth is seconds), or an alias such as ``@hourly``; one that never
    fires (``0 0 31 2 *``) is refused too."""
    if not isinstance(value, str):
        raise InvalidArgumentError(parameter, f"must be a cron expression string, got {type(value).__name__}")
    expression = " ".join(value.split())
    fields = len(expression.split(" "))
    if not expression.startswith("@") and fields not in (5, 6):
        raise InvalidArgumentError(
            parameter, f"must have 5 fields (or 6, the last being seconds), got {fields}: {value!r}"
        )
    if len(expression) > 255 or not croniter.is_valid(expression):
        raise InvalidArgumentError(parameter, f"is not a valid cron expression: {value!r}")
    try:
        croniter(expression, datetime(2000, 1, 1, tzinfo=timezone.utc)).get_next(datetime)
    except Exception:
        raise InvalidArgumentError(parameter, f"never fires: {value!r}") from None
    return expression


def next_tick(cron: str, after: datetime) -> datetime:
    """The first tick of the (checked) cron expression ``cron`` after ``after``."""
    tick: datetime = croniter(cron, after).get_next(datetime)
    return tick


@dataclass(frozen=True, eq=False)
class Periodic:
    """One schedule: enqueue ``task`` with ``payload`` on ``queue`` at every tick of ``cron`` (UTC).

    ``name`` identifies the schedule in ``sa_jobqueue_periodic`` (default: the
    task's name); two schedules of one task on one queue need distinct names.
    ``catch_up``: after downtime, enqueue every missed tick (True, at most
    :data:`MAX_CATCH_UP` per pass) or only the latest due one (False).
    """

    cron: str
    task: str
    name: str
    payload: Any = None
    queue: str = DEFAULT_QUEUE
    catch_up: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "cron", check_cron("cron", self.cron))
        check_name("task", self.task)
        check_name("name", self.name)
        check_bool("catch_up", self.catch_up)
        # The job's own checks (queue, priority, payload), as enqueue makes them, before any tick is due.
        check_name("queue", self.queue)
        int_between("priority", self.priority, PRIORITY_MIN, PRIORITY_MAX)
        check_payload({} if self.payload is None else self.payload)

    def ticks_after(self, after: datetime, now: datetime, limit: int) -> list[datetime]:
        """Up to ``limit`` ticks in ``(after, now]``, oldest first."""
        it = croniter(self.cron, after)
        ticks: list[datetime] = []
        while len(ticks) < limit:
            tick: datetime = it.get_next(datetime)
            if tick > now:
                break
            ticks.append(tick)
        return ticks

    def latest_tick(self, now: datetime) -> datetime:
        """The latest tick at or before ``now``."""
        tick: datetime = croniter(self.cron, now + timedelta(microseconds=1)).get_prev(datetime)
        return tick

    def dedupe_key(self, tick: datetime) -> str:
        """The dedupe key of this schedule's job for ``tick``: one job per tick,
        however many workers enqueue it (and kept by the job's retries)."""
        return f"{_DEDUPE_PREFIX}{self.name}{_DEDUPE_SEPARATOR}{tick.isoformat()}"

    @staticmethod
    def tick_of(job: Any) -> datetime | None:
        """The tick a periodic job was enqueued for (kept in its dedupe key, so
        retries keep it too); None for a job that is not periodic."""
        key = getattr(job, "dedupe_key", None)
        if not isinstance(key, str) or not key.startswith(_DEDUPE_PREFIX) or _DEDUPE_SEPARATOR not in key:
            return None
        try:
            return datetime.fromisoformat(key.rsplit(_DEDUPE_SEPARATOR, 1)[1])
        except ValueError:
            return None
