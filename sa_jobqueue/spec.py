"""Input checks: JobSpec, and one function per kind of argument of the public verbs.

:meth:`JobRepository.enqueue` builds a :class:`JobSpec`;
:meth:`JobRepository.enqueue_many` takes many. Every check here raises
:class:`InvalidArgumentError` naming the parameter, before any statement
runs, so bad input writes nothing (see docs/security.md).

What PostgreSQL or the driver would refuse only after a round trip is refused
here first:

* text (task, queue, dedupe key, worker name, payload keys and values) must
  not contain NUL (``\\x00``: PostgreSQL text and jsonb cannot hold it) nor
  lone surrogates (invalid UTF-8 decoded with ``surrogateescape``, or broken
  UTF-16: not Unicode, so not encodable);
* payloads are strict JSON with string keys, at most :data:`MAX_PAYLOAD_BYTES`
  once encoded;
* instants and durations stay within :data:`SCHEDULE_HORIZON` of now, so that
  every ``run_at`` the database computes can be read back as a Python
  ``datetime`` (years 1 to 9999).

Error text is the exception: a worker must always be able to record a
failure, so :func:`clean_error` repairs and shortens it instead of refusing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, scoped_session

from .errors import InvalidArgumentError
from .mixin import (
    CANCELLED,
    DEAD,
    DEDUPE_KEY_LENGTH,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    DONE,
    NAME_LENGTH,
    PRIORITY_MAX,
    PRIORITY_MIN,
)

if TYPE_CHECKING:
    from .retry import RetryPolicy

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

MAX_PAYLOAD_BYTES = 1024 * 1024
"""The largest payload accepted, in bytes of its compact UTF-8 JSON encoding (1 MiB).

A payload travels with its job on every claim: a worker claiming a batch of
100 holds 100 payloads in memory at once, and the queue table (hot, vacuumed
often) carries every byte of it in TOAST. A job should carry identifiers and
small parameters; put large data in a table or object store of its own and
enqueue its key. 1 MiB leaves room for any such payload (a few KB is typical)
while a batch of the largest stays within a worker's memory.
"""

MAX_ERROR_LENGTH = 10_000
"""The most characters of error text kept in ``last_error`` (see :func:`clean_error`)."""

SCHEDULE_HORIZON = timedelta(days=36525)
"""How far (100 years) from now an instant or a duration may reach.

PostgreSQL stores instants far beyond year 9999, but Python's ``datetime``
(and so the driver) cannot read them back: a job scheduled at
``datetime.max`` in a negative UTC offset, or ``now() + timedelta.max``,
would be written and then poison every statement that loads it. No job queue
schedules a century ahead; refusing earlier keeps every row readable.
"""

LOCKED_BY_LENGTH = 255
FINISHED_STATUSES = (DONE, DEAD, CANCELLED)
MAX_POLL_INTERVAL = 86400.0
_SHOW = 60


@dataclass(frozen=True)
class JobSpec:
    """What to enqueue. ``payload`` must be JSON: dicts with string keys,
    lists, strings, finite numbers, booleans and None, at most
    :data:`MAX_PAYLOAD_BYTES` encoded, with no NUL character in any string.

    ``priority``: lower runs first (-32768 … 32767, default 0).
    ``run_at`` (aware datetime) or ``delay`` (timedelta or seconds): when the
    job becomes runnable; default now; within :data:`SCHEDULE_HORIZON`.
    ``max_attempts``: the job's own limit, which wins over its task's; None
    leaves it to the task's, else 20 (:data:`~sa_jobqueue.mixin.DEFAULT_MAX_ATTEMPTS`).
    ``dedupe_key``: while a live (pending or running) job of the same queue
    holds this key, enqueueing returns that job instead of a new one.
    ``extra``: values for the model's own columns.
    """

    task: str
    payload: Any = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    run_at: datetime | None = None
    delay: timedelta | float | None = None
    max_attempts: int | None = None
    dedupe_key: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def _show(value: object) -> str:
    """``repr(value)``, cut short: an error message never carries a huge value."""
    text = repr(value)
    return text if len(text) <= _SHOW else f"{text[:_SHOW]}… ({len(text)} characters)"


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
    value = check_text(parameter, value)
    if not value.strip():
        raise InvalidArgumentError(parameter, "must not be empty")
    if len(value) > limit:
        raise InvalidArgumentError(parameter, f"must be at most {limit} characters, got {len(value)}")
    return value



def _int(parameter: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(parameter, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidArgumentError(parameter, f"must be between {low} and {high}, got {_show(value)}")
    return value


def positive_int(parameter: str, value: object, high: int = INT32_MAX) -> int:
    """Return ``value`` if it is an integer in 1 … ``high`` (not a bool); raise naming ``parameter``.

    The default ceiling is PostgreSQL's ``integer``: limits, attempts and
    sizes are bound as such, and a larger value would fail on the server.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise InvalidArgumentError(parameter, f"must be an integer from 1 to {high}, got {_show(value)}")
    return value


def check_bool(parameter: str, value: object) -> bool:
    """A flag must be a real bool: ``"no"`` is truthy, and a bug."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(parameter, f"must be True or False, got {_show(value)}")
    return value


# -- payloads --------------------------------------------------------------


def _payload_strings(payload: Any) -> str | None:
    """Walk a payload json.dumps accepted (so finite, acyclic and not too
    deep); describe the first key or string PostgreSQL cannot take, or None."""
    stack: list[Any] = [payload]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return f"has a string with a NUL character (\\x00), {_show(value)}; PostgreSQL jsonb cannot hold it"
        elif isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    return (
                        f"has a {type(key).__name__} key, {_show(key)}; JSON object keys are strings "
                        "(json.dumps would silently turn it into one)"
                    )
                if "\x00" in key:
                    return f"has a key with a NUL character (\\x00), {_show(key)}; PostgreSQL jsonb cannot hold it"
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return None


def check_payload(payload: Any, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Any:
    """Return the payload if it is strict JSON PostgreSQL can store; raise naming ``payload``.

    Refused: anything json.dumps cannot encode (objects, sets, bytes,
    Decimal, datetime…: a payload is data, never code, so nothing is
    pickled), NaN and infinity, circular or too deeply nested structures,
    non-string object keys, NUL characters and lone surrogates in any key or
    string, and an encoding longer than ``max_bytes`` (compact separators,
    UTF-8).
    """
    try:
        encoded = json.dumps(payload, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        raise InvalidArgumentError("payload", "is nested too deeply to encode as JSON") from None
    except ValueError as exc:  # NaN or infinity, a circular reference, a too long int
        raise InvalidArgumentError("payload", f"is not valid JSON: {exc}") from None
    except TypeError as exc:
        raise InvalidArgumentError("payload", f"is not JSON serializable: {exc}") from None
    try:
        size = len(encoded.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            "payload",
            f"contains a lone surrogate ({encoded[exc.start]!r}) in a key or string: not valid "
            "Unicode (undecodable bytes or broken UTF-16), so it cannot be encoded as UTF-8",
        ) from None
    if size > max_bytes:
        raise InvalidArgumentError(
            "payload",
            f"is {size} bytes as JSON, more than the limit of {max_bytes}; store large data "
            "elsewhere and enqueue a reference to it",
        )
    problem = _payload_strings(payload)
    if problem is not None:
        raise InvalidArgumentError("payload", problem)
    return payload


# -- instants and durations ----------------------------------------------


def _within_horizon(parameter: str, value: timedelta, *, shown: object = None) -> timedelta:
    if value > SCHEDULE_HORIZON:
        raise InvalidArgumentError(
            parameter,
            f"must be at most {SCHEDULE_HORIZON.days} days (100 years), got {_show(value if shown is None else shown)}",
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
            return _within_horizon(parameter, SCHEDULE_HORIZON + timedelta(seconds=1), shown=value)
        if value < 0:
            raise InvalidArgumentError(parameter, f"must not be negative, got {_show(value)}")
        value = timedelta(seconds=value)
    if value < timedelta(0):
        raise InvalidArgumentError(parameter, f"must not be negative, got {value}")
    return _within_horizon(parameter, value)


def check_duration(parameter: str, value: object) -> timedelta:
    """A positive timedelta up to :data:`SCHEDULE_HORIZON`: a lease, or a
    worker's heartbeat or reap interval."""
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidArgumentError(parameter, f"must be a positive timedelta, got {_show(value)}")
    return _within_horizon(parameter, value)


def check_timeout(parameter: str, value: object) -> timedelta:
    """A deadline or a wait: a positive timedelta or number of seconds, up to
    :data:`SCHEDULE_HORIZON`; returned as a timedelta."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise InvalidArgumentError(parameter, f"must be a positive number of seconds, got {_show(value)}")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidArgumentError(parameter, f"must be a positive timedelta or number of seconds, got {_show(value)}")
    return _within_horizon(parameter, value)


def check_lease(parameter: str, value: object) -> timedelta:
    """A lease: a positive timedelta of at most :data:`SCHEDULE_HORIZON`."""
    return check_duration(parameter, value)


def check_older_than(value: object) -> timedelta:
    """``purge(older_than=…)``: a timedelta from zero to :data:`SCHEDULE_HORIZON`."""
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise InvalidArgumentError("older_than", f"must be a timedelta of zero or more, got {_show(value)}")
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
    """A verb's ``session``: an ORM Session (or a scoped_session proxying one)."""
    if not isinstance(value, (Session, scoped_session)):
        raise InvalidArgumentError(
            "session", f"must be a sqlalchemy.orm.Session, got {type(value).__name__}"
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
        raise InvalidArgumentError("job_id", f"is out of the bigint range, got {_show(value)}")
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


def check_repositories(value: object) -> list[Any]:
    """A worker's ``repositories``: one JobRepository or a non-empty sequence of them."""
    from .repository import JobRepository

    if isinstance(value, JobRepository):
        return [value]
    if not isinstance(value, (Sequence, set, frozenset)) or isinstance(value, str):
        raise InvalidArgumentError("repositories", f"give one or more JobRepository, got {type(value).__name__}")
    repos = list(value)
    if not repos or not all(isinstance(r, JobRepository) for r in repos):
        raise InvalidArgumentError("repositories", "give one or more JobRepository")
    return repos


def check_specs(jobs: object) -> list[JobSpec]:
    """``enqueue_many``'s ``jobs``: an iterable (not a string) of JobSpec."""
    if isinstance(jobs, (str, bytes, Mapping)) or not isinstance(jobs, Iterable):
        raise InvalidArgumentError("jobs", f"must be an iterable of JobSpec, got {type(jobs).__name__}")
    specs = list(jobs)
    for spec in specs:
        if not isinstance(spec, JobSpec):
            raise InvalidArgumentError("jobs", f"items must be JobSpec, got {type(spec).__name__}")
    return specs


def check_task_limits(value: object) -> dict[str, int]:
    """``reap(task_max_attempts=…)``: a mapping of task name to a positive limit; None is empty."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            "task_max_attempts", f"must be a mapping of task name to max attempts, got {type(value).__name__}"
        )
    return {
        check_name("task_max_attempts", name): positive_int(f"task_max_attempts[{_show(name)}]", limit)
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
            "statuses", f"name finished statuses ({', '.join(FINISHED_STATUSES)}) only, got {_show(statuses)}"
        )
    return statuses


def check_policy(value: object) -> RetryPolicy:
    """``fail(policy=…)``: a RetryPolicy."""
    from .retry import RetryPolicy

    if not isinstance(value, RetryPolicy):
        raise InvalidArgumentError("policy", f"must be a RetryPolicy, got {type(value).__name__}")
    return value


def check_poll_interval(value: object) -> float:
    """A worker's ``poll_interval``: finite seconds, more than 0 and at most a day."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError("poll_interval", f"must be a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 < value <= MAX_POLL_INTERVAL):
        raise InvalidArgumentError(
            "poll_interval", f"must be more than 0 and at most {MAX_POLL_INTERVAL:.0f} seconds, got {value}"
        )
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


# -- one job ------------------------------------------------------------------


def _check_extra(extra: object, user_columns: frozenset[str]) -> dict[str, Any]:
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError("extra", "must be a mapping of column name to value")
    unknown = [key for key in extra if not isinstance(key, str) or key not in user_columns]
    if unknown:
        raise InvalidArgumentError(
            "extra",
            f"unknown column(s) {sorted(map(str, unknown))}; extra sets the model's own columns "
            f"({sorted(user_columns) or 'none'})",
        )
    for key, value in extra.items():
        if isinstance(value, str):
            problem = text_problem(value)
            if problem is not None:
                raise InvalidArgumentError("extra", f"column {key!r} {problem}")
    return dict(extra)


def to_row(
    spec: JobSpec, user_columns: frozenset[str], *, max_payload_bytes: int = MAX_PAYLOAD_BYTES
) -> dict[str, Any]:
    """Check ``spec`` and return the INSERT parameters for it."""
    if not isinstance(spec, JobSpec):
        raise InvalidArgumentError("jobs", f"items must be JobSpec, got {type(spec).__name__}")
    if spec.run_at is not None and spec.delay is not None:
        raise InvalidArgumentError("run_at", "give run_at or delay, not both")
    dedupe_key = spec.dedupe_key
    if dedupe_key is not None:
        dedupe_key = check_name("dedupe_key", dedupe_key, DEDUPE_KEY_LENGTH)
    row: dict[str, Any] = {
        "task": check_name("task", spec.task),
        "queue": check_name("queue", spec.queue),
        "payload": check_payload({} if spec.payload is None else spec.payload, max_bytes=max_payload_bytes),
        "priority": _int("priority", spec.priority, PRIORITY_MIN, PRIORITY_MAX),
        "max_attempts": None if spec.max_attempts is None else _int("max_attempts", spec.max_attempts, 1, INT32_MAX),
        "dedupe_key": dedupe_key,
        "run_at": check_aware("run_at", spec.run_at),
        "delay": check_delay("delay", spec.delay),
    }
    row.update(_check_extra(spec.extra, user_columns))
    return row
