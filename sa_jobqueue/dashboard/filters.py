"""The jobs list's filter, read from a request's query string and checked.

:func:`parse_filter` turns the query parameters of the jobs page into a
:class:`JobFilter`, or raises :class:`FilterError` naming the parameter, so a
bad filter is a 400 with a message on the page, never a 500, and no statement
runs with it. Plain values; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..checks import check_job_id, check_name
from ..errors import InvalidArgumentError
from ..states import NAME_LENGTH, STATUSES

# A pseudo-status of the jobs page: pending jobs whose run_at lies in the future.
SCHEDULED = "scheduled"
FILTER_STATUSES = (*STATUSES, SCHEDULED)
# The prefix of a filter on one of the table's own columns: ``col.tenant_id=7``.
COLUMN_PREFIX = "col."
PAGE_SIZE = 50
MAX_PATH_LENGTH = 500
MAX_VALUE_LENGTH = 500


class FilterError(ValueError):
    """A filter the jobs page cannot use; ``parameter`` names it."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter


@dataclass(frozen=True)
class JobFilter:
    """What the jobs list shows: every field is an equality (``payload_path``: a
    SQL/JSON path predicate the payload must satisfy), None for any."""

    status: str | None = None
    queue: str | None = None
    task: str | None = None
    job_id: int | None = None
    payload_path: str | None = None
    columns: Mapping[str, str] = field(default_factory=dict)
    before: int | None = None  # keyset: ids below this one (the page after the one that ended there)

    def query(self, **changes: object) -> dict[str, str]:
        """This filter as query parameters (without the keyset unless given in ``changes``)."""
        params: dict[str, str] = {}
        for name, value in (("status", self.status), ("queue", self.queue), ("task", self.task),
                            ("id", self.job_id), ("payload", self.payload_path)):
            if value is not None:
                params[name] = str(value)
        params.update({f"{COLUMN_PREFIX}{k}": v for k, v in self.columns.items()})
        params.update({k: str(v) for k, v in changes.items() if v is not None})
        return params


def _text(params: Mapping[str, str], name: str, limit: int = MAX_VALUE_LENGTH) -> str | None:
    value = params.get(name, "").strip()
    if not value:
        return None
    try:
        return check_name(name, value, limit)
    except InvalidArgumentError as exc:
        raise FilterError(name, str(exc).split(": ", 1)[1]) from None


def _int(params: Mapping[str, str], name: str) -> int | None:
    value = params.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise FilterError(name, f"must be a job id (a positive whole number), got {value[:40]!r}")
    try:
        return check_job_id(int(value))
    except InvalidArgumentError as exc:
        raise FilterError(name, str(exc).split(": ", 1)[1]) from None


def parse_filter(params: Mapping[str, str], user_columns: frozenset[str]) -> JobFilter:
    """The filter of the jobs page's query ``params``; raise :class:`FilterError`.

    ``status``: a job status or ``scheduled``; ``queue``, ``task``: names;
    ``id``, ``before``: job ids; ``payload``: a SQL/JSON path predicate
    (``$.user_id == 42``), checked by PostgreSQL when the page runs;
    ``col.<name>``: the text of one of ``user_columns``. Unknown parameters
    are an error, so a misspelt filter never silently shows every job.
    """
    known = {"status", "queue", "task", "id", "payload", "before", "table"}
    unknown = sorted(k for k in params if k not in known and not k.startswith(COLUMN_PREFIX))
    if unknown:
        raise FilterError(unknown[0], f"is not a filter of the jobs page (filters: {', '.join(sorted(known))}, "
                                      f"{COLUMN_PREFIX}<column>)")
    status = _text(params, "status")
    if status is not None and status not in FILTER_STATUSES:
        raise FilterError("status", f"must be one of {', '.join(FILTER_STATUSES)}, got {status[:40]!r}")
    columns: dict[str, str] = {}
    for key, value in params.items():
        if not key.startswith(COLUMN_PREFIX) or not value.strip():
            continue
        name = key[len(COLUMN_PREFIX):]
        if name not in user_columns:
            raise FilterError(key, f"is not a column of this table's own ({', '.join(sorted(user_columns)) or 'none'})")
        checked = _text(params, key)
        if checked is not None:
            columns[name] = checked
    return JobFilter(
        status=status, queue=_text(params, "queue", NAME_LENGTH), task=_text(params, "task", NAME_LENGTH),
        job_id=_int(params, "id"),
        payload_path=_text(params, "payload", MAX_PATH_LENGTH), columns=columns, before=_int(params, "before"),
    )


__all__ = ["COLUMN_PREFIX", "FILTER_STATUSES", "PAGE_SIZE", "SCHEDULED", "FilterError", "JobFilter", "parse_filter"]
