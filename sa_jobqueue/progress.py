"""Progress: a running handler says how far it is, and its heartbeat carries it.

::

    @tasks.task
    def export(job: ExportJob, session: Session) -> None:
        for n, chunk in enumerate(chunks, 1):
            write(chunk)
            report_progress(job, n / len(chunks), f"chunk {n} of {len(chunks)}")

    @tasks.task
    def resize(ctx: JobContext, image_id: int) -> None:
        ctx.report_progress(0.5, "thumbnails done")

:func:`report_progress` costs no statement: it keeps the latest report on
the job object the handler holds. In lease mode the worker's next heartbeat
writes it to the job's ``progress`` column (a JSON object ``{"fraction",
"message"}``), one statement per table for every job whose progress changed
since the last beat, fenced like the heartbeat; reports in between are
coalesced, so a handler may report as often as it likes. Every worker also
shows its running jobs' progress in its presence row (the dashboard's Workers
page). In transaction mode the job's row is locked by the job's own
transaction until it commits, so its progress is shown on the Workers page
only. The claim clears ``progress``: a retry starts from nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sqlalchemy import BigInteger, Table, Text, Uuid, bindparam, cast, func, select, update
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Session

from .checks import check_text
from .errors import InvalidArgumentError
from .states import RUNNING

__all__ = ["PROGRESS_MESSAGE_LENGTH", "Progress", "progress_of", "record_progress", "report_progress"]

PROGRESS_MESSAGE_LENGTH = 200
"""The most characters of a progress message."""


@dataclass(frozen=True)
class Progress:
    """How far a running job is: ``fraction`` from 0.0 to 1.0, and a short message."""

    fraction: float
    message: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "message": self.message}

    @classmethod
    def from_json(cls, value: object) -> Progress | None:
        """The progress stored in a job's ``progress`` column, or None (none, or not one of ours)."""
        if not isinstance(value, dict):
            return None
        fraction, message = value.get("fraction"), value.get("message", "")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not isinstance(message, str):
            return None
        return cls(float(fraction), message)


def report_progress(job: Any, fraction: float, message: str = "") -> Progress:
    """Report how far the handler of ``job`` (the claimed job it was given) is.

    Raises :class:`~sa_jobqueue.InvalidArgumentError` naming ``fraction``
    (not a number from 0 to 1) or ``message`` (not text, or longer than
    :data:`PROGRESS_MESSAGE_LENGTH`), and then keeps the last good report."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise InvalidArgumentError("fraction", f"must be a number from 0 to 1, got {type(fraction).__name__}")
    if not math.isfinite(fraction) or not 0 <= fraction <= 1:
        raise InvalidArgumentError("fraction", f"must be from 0 to 1, got {fraction!r}")
    message = check_text("message", message)
    if len(message) > PROGRESS_MESSAGE_LENGTH:
        raise InvalidArgumentError("message", f"must be at most {PROGRESS_MESSAGE_LENGTH} characters, "
                                              f"got {len(message)}")
    if not hasattr(job, "lock_token") or not hasattr(job, "progress"):
        raise InvalidArgumentError("job", f"must be a claimed job of a JobMixin model, got {type(job).__name__}")
    progress = Progress(float(fraction), message)
    # A new object each time: the heartbeat tells a new report by identity.
    job.progress = progress.as_json()
    return progress


def progress_of(job: Any) -> Progress | None:
    """The last progress reported for ``job`` (a claimed job, or a job row read later)."""
    return Progress.from_json(getattr(job, "progress", None))


def record_progress(session: Session, table: Table, jobs: Sequence[Any]) -> set[int]:
    """Write the progress of claimed ``jobs`` of ``table``, fenced on their claim
    (a job no longer owned or no longer running is left alone); return the ids written."""
    if not jobs:
        return set()
    params = {
        "ids": [job.id for job in jobs],
        "tokens": [job.lock_token for job in jobs],
        "values": [json.dumps(job.progress) for job in jobs],
    }
    rows = session.execute(_statement(table), params, execution_options={"synchronize_session": False})
    return {row.id for row in rows}


@lru_cache(maxsize=64)
def _statement(t: Table) -> Any:
    given = select(
        func.unnest(bindparam("ids", type_=ARRAY(BigInteger()))).label("id"),
        func.unnest(bindparam("tokens", type_=ARRAY(Uuid()))).label("token"),
        func.unnest(bindparam("values", type_=ARRAY(Text()))).label("progress"),
    ).subquery("given")
    return (
        update(t)
        .where(t.c.id == given.c.id, t.c.lock_token == given.c.token, t.c.status == RUNNING)
        .values(progress=cast(given.c.progress, JSONB))
        .returning(t.c.id)
    )
