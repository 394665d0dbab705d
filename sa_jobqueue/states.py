"""The words of a job table: its states, defaults and limits, the columns'
defaults, and the partial index predicates built from them. Plain values;
this module imports nothing of the package, so every other module can use them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

from sqlalchemy import TextClause, text

PENDING = "pending"
RUNNING = "running"
DONE = "done"
DEAD = "dead"
CANCELLED = "cancelled"
STATUSES = (PENDING, RUNNING, DONE, DEAD, CANCELLED)
LIVE_STATUSES = (PENDING, RUNNING)

DEFAULT_QUEUE = "default"
DEFAULT_MAX_ATTEMPTS = 20
NAME_LENGTH = 128
DEDUPE_KEY_LENGTH = 255
PRIORITY_MIN = -32768
PRIORITY_MAX = 32767
SCHEDULE_HORIZON = timedelta(days=36525)
"""How far (100 years) from now an instant or a duration may reach.

PostgreSQL stores instants far beyond year 9999, but Python's ``datetime``
(and so the driver) cannot read them back: a job scheduled at
``datetime.max`` in a negative UTC offset, or ``now() + timedelta.max``,
would be written and then poison every statement that loads it. No job queue
schedules a century ahead; refusing earlier keeps every row readable.
"""


def sql_list(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


# The claim's WHERE clause on status, verbatim. The claim statement and the
# claim index are both built from it so that they cannot drift apart.
CLAIM_PREDICATE = f"status = '{PENDING}'"
LEASE_PREDICATE = f"status = '{RUNNING}'"
DEDUPE_PREDICATE = f"dedupe_key IS NOT NULL AND status IN ({sql_list(LIVE_STATUSES)})"
# The finished jobs a dedupe window looks up (sa_jobqueue.dedupe), on tables that keep them.
DEDUPE_DONE_PREDICATE = f"dedupe_key IS NOT NULL AND status = '{DONE}'"
# The jobs the dashboard lists and counts by status and queue through an index: all but the running
# ones, so that a claim (pending to running) writes no entry there; the running are few, in the lease index.
STATUS_INDEXED = (PENDING, DONE, DEAD, CANCELLED)
STATUS_INDEX_PREDICATE = f"status IN ({sql_list(STATUS_INDEXED)})"
# The dedupe_until of a job whose key is held until it starts: the claim clears
# its dedupe_key (sa_jobqueue.dedupe). NULL: held while the job is live.
RELEASED_AT_START = "started"


# What a job column holds when an enqueue leaves it out, as Python values. The
# columns' server defaults below are rendered from it, and the COPY path of
# enqueue_many (bulk.py) fills its snapshots in from it, so the two cannot
# drift. run_at and created_at default to now(); the other columns to NULL.
COLUMN_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "queue": DEFAULT_QUEUE, "payload": {}, "status": PENDING, "priority": 0, "attempts": 0,
})
NOW_DEFAULTS = frozenset({"run_at", "created_at"})


def server_default(key: str) -> str | TextClause:
    """The server default of job column ``key``, rendered from :data:`COLUMN_DEFAULTS`:
    a string as itself (SQLAlchemy quotes it), a number or JSON as a SQL literal."""
    value = COLUMN_DEFAULTS[key]
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return text(str(value))
    return text("'" + json.dumps(value).replace("'", "''") + "'")
