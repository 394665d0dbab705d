"""JobSpec: what to enqueue, and the row it becomes.

:meth:`JobRepository.enqueue` builds a :class:`JobSpec`;
:meth:`JobRepository.enqueue_many` takes many. :func:`to_row` checks one
and returns its INSERT parameters, raising :class:`InvalidArgumentError`
naming the parameter before any statement runs, so a bad spec writes
nothing (see docs/security.md). Besides the checks of
:mod:`sa_jobqueue.checks` (names, priority, instants), payloads are strict
JSON with string keys, at most :data:`MAX_PAYLOAD_BYTES` once encoded, with
no NUL character (``\\x00``: PostgreSQL jsonb cannot hold it) nor lone
surrogate in any key or string.

The argument checks of the other verbs live in :mod:`sa_jobqueue.checks`;
the names they had here are still importable from this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, get_args

from .checks import (
    FINISHED_STATUSES,
    INT32_MAX,
    INT64_MAX,
    LOCKED_BY_LENGTH,
    MAX_ERROR_LENGTH,
    MAX_POLL_INTERVAL,
    check_aware,
    check_bool,
    check_claimed,
    check_claimed_many,
    check_delay,
    check_duration,
    check_job_id,
    check_lease,
    check_name,
    check_older_than,
    check_poll_interval,
    check_queues,
    check_session,
    check_statuses,
    check_task_limits,
    check_text,
    check_timeout,
    check_worker_name,
    clean_error,
    int_between,
    positive_int,
    text_problem,
)
from .dedupe import ROW_KEY, Dedupe, HeldUntil, OnConflict
from .errors import InvalidArgumentError, shown
from .payloads import MAX_PAYLOAD_BYTES, check_meta, check_payload, encode_payload
from .states import DEDUPE_KEY_LENGTH, DEFAULT_QUEUE, PRIORITY_MAX, PRIORITY_MIN, RELEASED_AT_START, SCHEDULE_HORIZON

"""The largest payload accepted, in bytes of its compact UTF-8 JSON encoding (1 MiB).

A payload travels with its job on every claim: a worker claiming a batch of
100 holds 100 payloads in memory at once, and the queue table (hot, vacuumed
often) carries every byte of it in TOAST. A job should carry identifiers and
small parameters; put large data in a table or object store of its own and
enqueue its key. 1 MiB leaves room for any such payload (a few KB is typical)
while a batch of the largest stays within a worker's memory.
"""


class _Factory:
    """JobSpec's ``extra`` when none is given: each spec then gets a dict of its own.
    Shown as dataclasses show a default factory, so the signature reads as it always did."""

    def __repr__(self) -> str:
        return "<factory>"


_FRESH: Any = _Factory()


@dataclass(frozen=True, init=False)
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
    holds this key, enqueueing returns that job instead of a new one; a
    :class:`~sa_jobqueue.Dedupe` says what else to do then, and for how long
    the key is held (:mod:`sa_jobqueue.dedupe`).
    ``extra``: values for the model's own columns.
    ``meta``: what travels with the job besides its payload (a JSON object,
    at most :data:`~sa_jobqueue.payloads.MAX_META_BYTES` encoded), stored in
    its ``meta`` column; enqueue hooks (:mod:`sa_jobqueue.enqueue_hooks`) add to it.
    """

    task: str
    payload: Any = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    run_at: datetime | None = None
    delay: timedelta | float | None = None
    max_attempts: int | None = None
    dedupe_key: str | Dedupe | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    meta: Mapping[str, Any] | None = None

    # Written out rather than generated: a frozen dataclass's own __init__
    # sets each field through object.__setattr__, 1.4 µs for ten fields
    # against 0.5 µs here, paid for every job of a bulk enqueue. The same
    # parameters, defaults and values as the generated one.
    def __init__(
        self, task: str, payload: Any = None, queue: str = DEFAULT_QUEUE, priority: int = 0,
        run_at: datetime | None = None, delay: timedelta | float | None = None, max_attempts: int | None = None,
        dedupe_key: str | Dedupe | None = None, extra: Mapping[str, Any] = _FRESH,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        fields = self.__dict__
        fields["task"] = task
        fields["payload"] = payload
        fields["queue"] = queue
        fields["priority"] = priority
        fields["run_at"] = run_at
        fields["delay"] = delay
        fields["max_attempts"] = max_attempts
        fields["dedupe_key"] = dedupe_key
        fields["extra"] = {} if extra is _FRESH else extra
        fields["meta"] = meta


def check_specs(jobs: object) -> list[JobSpec]:
    """``enqueue_many``'s ``jobs``: an iterable (not a string) of JobSpec."""
    if isinstance(jobs, (str, bytes, Mapping)) or not isinstance(jobs, Iterable):
        raise InvalidArgumentError("jobs", f"must be an iterable of JobSpec, got {type(jobs).__name__}")
    specs = list(jobs)
    for spec in specs:
        if not isinstance(spec, JobSpec):
            raise InvalidArgumentError("jobs", f"items must be JobSpec, got {type(spec).__name__}")
    return specs


def check_dedupe(value: object) -> Dedupe | None:
    """A ``dedupe_key`` argument, checked: None, a key (as ``Dedupe(key)``) or a :class:`Dedupe`."""
    if value is None:
        return None
    if isinstance(value, str):
        return Dedupe(check_name("dedupe_key", value, DEDUPE_KEY_LENGTH))
    if not isinstance(value, Dedupe):
        raise InvalidArgumentError("dedupe_key", f"must be a string or a Dedupe, got {type(value).__name__}")
    key = check_name("dedupe_key", value.key, DEDUPE_KEY_LENGTH)
    for name, allowed in (("on_conflict", get_args(OnConflict)), ("until", get_args(HeldUntil))):
        given = getattr(value, name)
        if given not in allowed:
            raise InvalidArgumentError(f"dedupe_key.{name}", f"must be one of {', '.join(allowed)}; got {shown(given)}")
    window = value.window
    if window is not None:
        window = check_duration("dedupe_key.window", window)
        if value.until != "finished":
            raise InvalidArgumentError("dedupe_key.window", "counts finished jobs: it needs until='finished'")
    return Dedupe(key, value.on_conflict, value.until, window)



# -- one job ------------------------------------------------------------------


_NO_DELAY = timedelta(0)  # what check_delay makes of None


def _check_extra(extra: object, user_columns: frozenset[str]) -> dict[str, Any]:
    if type(extra) is dict and not extra:  # JobSpec's default, without the Mapping check's cost
        return {}
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
    return checked_row(spec, user_columns, max_payload_bytes=max_payload_bytes)[0]


def checked_row(
    spec: JobSpec, user_columns: frozenset[str], *, max_payload_bytes: int = MAX_PAYLOAD_BYTES
) -> tuple[dict[str, Any], str]:
    """:func:`to_row`, and the payload as the :func:`~sa_jobqueue.jsontext.compact_json` its check made."""
    if not isinstance(spec, JobSpec):
        raise InvalidArgumentError("jobs", f"items must be JobSpec, got {type(spec).__name__}")
    if spec.run_at is not None and spec.delay is not None:
        raise InvalidArgumentError("run_at", "give run_at or delay, not both")
    # The fields a spec leaves at their defaults pass without a call each: a
    # bulk enqueue checks thousands of specs, most of them so.
    dedupe = None if spec.dedupe_key is None else check_dedupe(spec.dedupe_key)
    task, queue, payload, text = _names_and_payload(spec, max_payload_bytes)
    priority = spec.priority
    if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        priority = int_between("priority", priority, PRIORITY_MIN, PRIORITY_MAX)
    row: dict[str, Any] = {
        "task": task,
        "queue": queue,
        "payload": payload,
        "priority": priority,
        "max_attempts": (
            None if spec.max_attempts is None else int_between("max_attempts", spec.max_attempts, 1, INT32_MAX)
        ),
        "dedupe_key": None if dedupe is None else dedupe.key,
        "run_at": None if spec.run_at is None else check_aware("run_at", spec.run_at),
        "delay": _NO_DELAY if spec.delay is None else check_delay("delay", spec.delay),
    }
    if dedupe is not None:
        # Not a column: what the enqueue does on a conflict (sa_jobqueue.enqueue takes it out of the row).
        row[ROW_KEY] = dedupe
        if dedupe.until == "started":
            row["dedupe_until"] = RELEASED_AT_START
    if spec.meta is not None:  # no key otherwise: the statements without meta stay the ones they were
        row["meta"] = check_meta(spec.meta)
    extra = _check_extra(spec.extra, user_columns)
    if extra:
        row.update(extra)
    return row, text


def checked_rows(jobs: object, user_columns: frozenset[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """``enqueue_many``'s ``jobs`` (:func:`check_specs`), each checked by :func:`checked_row`: the
    rows, and apart, each payload's JSON text as its check made it (what COPY sends, so that a
    bulk enqueue encodes each payload once). The first bad spec raises, before anything is sent."""
    checked = [checked_row(spec, user_columns) for spec in check_specs(jobs)]
    return [row for row, _ in checked], [text for _, text in checked]


def plain_fields(spec: object, *, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> tuple[str, str, str] | None:
    """A spec that sets nothing but its task, queue and payload (every other
    field at its default): its task, queue and payload as the
    :func:`~sa_jobqueue.jsontext.compact_json` its check made, each checked
    as :func:`checked_row` checks it, the first error raised as there. None,
    nothing checked, for any other spec: :func:`checked_row` then decides.

    What a bulk load of plain jobs needs, without the row's dictionary
    :func:`checked_row` builds (a container the cyclic garbage collector
    then tracks, one per job)."""
    if (type(spec) is not JobSpec or type(spec.priority) is not int or spec.priority != 0
            or spec.run_at is not None or spec.delay is not None or spec.max_attempts is not None
            or spec.dedupe_key is not None or spec.meta is not None or type(spec.extra) is not dict or spec.extra):
        return None
    task, queue, _, text = _names_and_payload(spec, max_payload_bytes)
    return task, queue, text


def _names_and_payload(spec: JobSpec, max_payload_bytes: int) -> tuple[str, str, Any, str]:
    """``spec``'s task and queue, its payload (``{}`` for None) and the payload's JSON text,
    checked in this order, so that the first error is the one raised."""
    task, queue = check_name("task", spec.task), check_name("queue", spec.queue)
    payload = {} if spec.payload is None else spec.payload
    return task, queue, payload, encode_payload(payload, max_bytes=max_payload_bytes)


__all__ = [
    "FINISHED_STATUSES", "INT32_MAX", "INT64_MAX", "LOCKED_BY_LENGTH", "MAX_ERROR_LENGTH", "MAX_PAYLOAD_BYTES",
    "MAX_POLL_INTERVAL", "SCHEDULE_HORIZON", "JobSpec", "check_aware", "check_bool", "check_claimed",
    "check_claimed_many", "check_dedupe", "check_delay", "check_duration", "check_job_id", "check_lease", "check_name",
    "check_older_than", "check_payload", "check_poll_interval", "check_queues", "check_session", "check_specs",
    "check_statuses", "check_task_limits", "check_text", "check_timeout", "check_worker_name", "checked_row",
    "checked_rows", "clean_error", "int_between", "plain_fields", "positive_int", "shown", "text_problem", "to_row",
]
