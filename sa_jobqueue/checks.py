"""Argument checks: one function per kind of argument of the public verbs.

Every check raises :class:`InvalidArgumentError` naming the parameter,
before any statement runs, so bad input writes nothing (see
docs/security.md). What PostgreSQL or the driver would refuse only after a
round trip is refused here first:

* text (task, queue, dedupe key, worker name) must not contain NUL
  (``\\x00``: PostgreSQL text cannot hold it) nor lone surrogates (invalid
  UTF-8 decoded with ``surrogateescape``, or broken UTF-16: not Unicode, so
  not encodable);
* integers fit the column they are bound to;
* instants and durations stay within :data:`SCHEDULE_HORIZON` of now, so that
  every ``run_at`` the database computes can be read back as a Python
  ``datetime`` (years 1 to 9999).

Error text is the exception: a worker must always be able to record a
failure, so :func:`clean_error` repairs and shortens it instead of refusing.
The job's own content (payload, extra columns) is checked by
:mod:`sa_jobqueue.spec`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy.orm import Session, scoped_session

from .errors import InvalidArgumentError, shown
from .states import CANCELLED, DEAD, DONE, NAME_LENGTH, SCHEDULE_HORIZON

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

MAX_ERROR_LENGTH = 10_000
"""The most characters of error text kept in ``last_error`` (see :func:`clean_error`)."""
LOCKED_BY_LENGTH = 255
FINISHED_STATUSES = (DONE, DEAD, CANCELLED)
MAX_POLL_INTERVAL = 86400.0
# -- text and numbers --------------------------------------------------------


def text_problem(value: str) -> str | None:
    """Why PostgreSQL cannot store ``value`` as text, or None when it can."""
    index = value.find("\x00")
    if index >= 0:
        return f"contains a NUL character (\\x00) at index {index}; PostgreSQL text cannot hold it"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"contains a lone surrogate ({value[exc.start]!r}) at index {exc.start}: not valid "
            "Unicode (undecodable bytes or broken UTF-16), so it cannot be encoded as UTF-8"
        )
    return None


def check_text(parameter: str, value: object) -> str:
    """Return ``value`` if it is a string PostgreSQL can store; raise naming ``parameter``."""
    if not isinstance(value, str):
        raise InvalidArgumentError(parameter, f"must be a string, got {type(value).__name__}")
    problem = text_problem(value)
    if problem is not None:
        raise InvalidArgumentError(parameter, problem)
    return value


def check_name(parameter: str, value: object, limit: int = NAME_LENGTH) -> str:
    """A task, queue or dedupe key: a non-blank storable string of at most ``limit`` characters.

    Any other character is legal (quotes, semicolons, ``$$``, backslashes…):
    names only ever travel as bound parameters.
    """
    if not isinstance(value, str):
        raise InvalidArgumentError(parameter, f"must be a string, got {type(value).__name__}")
    # Remembered for names that fit: a bulk enqueue checks the same few task and queue names at every row.
    problem = (_name_problem if len(value) <= limit else _name_problem.__wrapped__)(value, limit)
    if problem is not None:
        raise InvalidArgumentError(parameter, problem)
    return value


@functools.lru_cache(maxsize=1024)
def _name_problem(value: str, limit: int) -> str | None:
    """Why ``value`` is no name of at most ``limit`` characters (see :func:`check_name`), or None."""
    problem = text_problem(value)
    if problem is not None:
        return problem
    if not value.strip():
        return "must not be empty"
    if len(value) > limit:
        return f"must be at most {limit} characters, got {len(value)}"
    return None


def int_between(parameter: str, value: object, low: int, high: int) -> int:
    """Return ``value`` if it is an integer in ``low`` … ``high`` (not a bool); raise naming ``parameter``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(parameter, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidArgumentError(parameter, f"must be between {low} and {high}, got {shown(value)}")
    return value


def positive_int(parameter: str, value: object, high: int = INT32_MAX) -> int:
    """Return ``value`` if it is an integer in 1 … ``high`` (not a bool); raise naming ``parameter``.

    The default ceiling is PostgreSQL's ``integer``: limits, attempts and
    sizes are bound as such, and a larger value would fail on the server.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise InvalidArgumentError(parameter, f"must be an integer from 1 to {high}, got {shown(value)}")
    return value


def check_bool(parameter: str, value: object) -> bool:
    """A flag must be a real bool: ``"no"`` is truthy, and a bug."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(parameter, f"must be True or False, got {shown(value)}")
    return value


# -- instants and durations ----------------------------------------------


def _within_horizon(parameter: str, value: timedelta, *, given: object = None) -> timedelta:
    if value > SCHEDULE_HORIZON:
        raise InvalidArgumentError(
            parameter,
            f"must be at most {SCHEDULE_HORIZON.days} days (100 years), got {shown(value if given is None else given)}",
        )
    return value


def check_delay(parameter: str, value: timedelta | float | None) -> timedelta:
    """A wait: a timedelta or finite seconds, from zero to :data:`SCHEDULE_HORIZON`; None is zero."""
    if value is None:
        return timedelta(0)
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise InvalidArgumentError(parameter, "must be a timedelta or a number of seconds")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgumentError(parameter, f"must be finite, got {value}")
    if isinstance(value, (int, float)):
        # Compare before converting: timedelta(seconds=1e300) overflows.
        if value > SCHEDULE_HORIZON.total_seconds():
            return _within_horizon(parameter, SCHEDULE_HORIZON + timedelta(seconds=1), given=value)
        if value < 0:
            raise InvalidArgumentError(parameter, f"must not be negative, got {shown(value)}")
        value = timedelta(seconds=value)
    if value < timedelta(0):
        raise InvalidArgumentError(parameter, f"must not be negative, got {value}")
    return _within_horizon(parameter, value)


def check_duration(parameter: str, value: object) -> timedelta:
    """A positive timedelta up to :data:`SCHEDULE_HORIZON`: a lease, or a
    worker's heartbeat or reap interval."""
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidArgumentError(parameter, f"must be a positive timedelta, got {shown(value)}")
    return _within_horizon(parameter, value)


def check_timeout(parameter: str, value: object) -> timedelta:
    """A deadline or a wait: a positive timedelta or number of seconds, up to
    :data:`SCHEDULE_HORIZON`; returned as a timedelta."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise InvalidArgumentError(parameter, f"must be a positive number of seconds, got {shown(value)}")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidArgumentError(parameter, f"must be a positive timedelta or number of seconds, got {shown(value)}")
    return _within_horizon(parameter, value)


def check_lease(parameter: str, value: object) -> timedelta:
    """A lease: a positive timedelta of at most :data:`SCHEDULE_HORIZON`."""
    return check_duration(parameter, value)


def check_older_than(value: object) -> timedelta:
    """``purge(older_than=…)``: a timedelta from zero to :data:`SCHEDULE_HORIZON`."""
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise InvalidArgumentError("older_than", f"must be a timedelta of zero or more, got {shown(value)}")
    return _within_horizon("older_than", value)


def check_aware(parameter: str, value: datetime | None) -> datetime | None:
    """An instant: an aware datetime within :data:`SCHEDULE_HORIZON` of now; None passes."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidArgumentError(parameter, f"must be a datetime, got {type(value).__name__}")
    try:
        offset = value.utcoffset()
    except (ValueError, TypeError) as exc:  # a tzinfo returning a bad offset
        raise InvalidArgumentError(parameter, f"has an invalid UTC offset: {exc}") from None
    if value.tzinfo is None or offset is None:
        raise InvalidArgumentError(
            parameter, "must be timezone-aware (a naive datetime has no defined instant)"
        )
    distance = value - datetime.now(timezone.utc)
    if abs(distance) > SCHEDULE_HORIZON:
        raise InvalidArgumentError(
            parameter,
            f"must be within {SCHEDULE_HORIZON.days} days (100 years) of now, got {value.isoformat()}",
        )
    return value


# -- the verbs' other arguments -------------------------------------------


def check_session(value: object) -> Any:
    """A verb's ``session``: an ORM Session, or a scoped_session, for which
    the Session it proxies is returned (the verbs use Session methods a
    proxy does not forward, such as ``get_transaction``)."""
    if isinstance(value, scoped_session):
        return value()
    if not isinstance(value, Session):
        # By name: the core never imports SQLAlchemy's asyncio extension.
        hint = " (an AsyncSession takes sa_jobqueue.aio.AsyncJobRepository)" if type(value).__name__ in (
            "AsyncSession", "async_scoped_session") else ""
        raise InvalidArgumentError(
            "session", f"must be a sqlalchemy.orm.Session, got {type(value).__name__}{hint}"
        )
    return value


def check_queues(queues: object, parameter: str = "queues") -> list[str]:
    """One queue name or a non-empty sequence of them, each as :func:`check_name`."""
    if isinstance(queues, str):
        queues = [queues]
    if not isinstance(queues, (Sequence, set, frozenset)):
        raise InvalidArgumentError(
            parameter, f"must be a queue name or a sequence of them, got {type(queues).__name__}"
        )
    result = list(queues)
    if not result:
        raise InvalidArgumentError(parameter, "name at least one queue")
    return [check_name(parameter, name) for name in result]


def check_worker_name(parameter: str, value: object) -> str | None:
    """A worker name (kept in ``locked_by``): None for the default, else a
    non-blank storable string of at most 255 characters."""
    if value is None:
        return None
    return check_name(parameter, value, LOCKED_BY_LENGTH)


def check_job_id(value: object) -> int:
    """A job id: an integer PostgreSQL's ``bigint`` can hold (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError("job_id", f"must be an integer, got {type(value).__name__}")
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise InvalidArgumentError("job_id", f"is out of the bigint range, got {shown(value)}")
    return value


def check_claimed(parameter: str, job: object, model: type) -> Any:
    """A job the caller claimed: an instance of the repository's ``model``
    holding a claim's ``lock_token``."""
    if not isinstance(job, model):
        raise InvalidArgumentError(
            parameter, f"must be a {model.__name__} job, got {type(job).__name__}"
        )
    if getattr(job, "lock_token", None) is None:
        raise InvalidArgumentError(
            parameter, f"{model.__name__} {getattr(job, 'id', None)} is not claimed (it has no lock_token)"
        )
    return job


def check_claimed_many(parameter: str, jobs: object, model: type) -> list[Any]:
    """A sequence (not a string) of claimed jobs, each as :func:`check_claimed`."""
    if isinstance(jobs, (str, bytes)) or not isinstance(jobs, (Sequence, set, frozenset)):
        raise InvalidArgumentError(
            parameter, f"must be a sequence of {model.__name__} jobs, got {type(jobs).__name__}"
        )
    return [check_claimed(parameter, job, model) for job in jobs]

def check_task_limits(value: object) -> dict[str, int]:
    """``reap(task_max_attempts=…)``: a mapping of task name to a positive limit; None is empty."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            "task_max_attempts", f"must be a mapping of task name to max attempts, got {type(value).__name__}"
        )
    return {
        check_name("task_max_attempts", name): positive_int(f"task_max_attempts[{shown(name)}]", limit)
        for name, limit in value.items()
    }


def check_statuses(value: object) -> list[str]:
    """``purge(statuses=…)``: finished statuses only (done, dead, cancelled)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (Sequence, set, frozenset)):
        raise InvalidArgumentError("statuses", f"must be a sequence of statuses, got {type(value).__name__}")
    statuses = list(value)
    bad = [s for s in statuses if s not in FINISHED_STATUSES]
    if bad or not statuses:
        raise InvalidArgumentError(
            "statuses", f"name finished statuses ({', '.join(FINISHED_STATUSES)}) only, got {shown(statuses)}"
        )
    return statuses

def check_poll_interval(value: object) -> float:
    """A worker's ``poll_interval``: finite seconds, more than 0 and at most a day."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError("poll_interval", f"must be a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 < value <= MAX_POLL_INTERVAL):
        raise InvalidArgumentError(
            "poll_interval", f"must be more than 0 and at most {MAX_POLL_INTERVAL:.0f} seconds, got {value}"
        )
    return float(value)


def check_interval(parameter: str, value: object) -> float:
    """A worker's ``periodic_interval``: finite seconds, more than 0 and at most an hour."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(parameter, f"must be a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 < value <= 3600):
        raise InvalidArgumentError(parameter, f"must be more than 0 and at most 3600 seconds, got {value}")
    return float(value)


# -- error text -------------------------------------------------------------


def clean_error(error: object, limit: int = MAX_ERROR_LENGTH) -> str:
    """The text ``fail`` keeps in ``last_error``: never refused, always storable.

    ``str(error)`` (or a description of the object when even that raises),
    with each NUL character and lone surrogate replaced by U+FFFD, and, when
    longer than ``limit`` characters, its head and tail kept around a marker
    saying how many characters were cut: a traceback's first lines say
    where, its last line says what.
    """
    try:
        text = error if isinstance(error, str) else str(error)
    except Exception as exc:  # a failure must be recordable whatever __str__ does
        text = f"<{type(error).__name__} object; str() raised {type(exc).__name__}>"
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    if len(text) <= limit:
        return text
    # The marker's length depends on the count it shows; size it for the
    # largest count possible, so the result never exceeds the limit.
    keep = max(0, limit - len(_cut_marker(len(text))))
    if keep == 0:
        return text[:limit]
    head = keep // 2
    return text[:head] + _cut_marker(len(text) - keep) + text[len(text) - (keep - head):]


def _cut_marker(cut: int) -> str:
    return f"\n… [{cut} characters cut] …\n"
