"""Results: what a handler returns, stored with its job's completion, and read back.

A handler may return a JSON value. On a table that keeps finished jobs
(``__keep_done__ = True``) the worker stores it in the job's ``result``
column in the transaction that completes the job (the same one as the
handler's writes, when it takes the session), and notifies the table's
results channel there, so a waiter learns of it when it commits. A task
whose handler is annotated to return something other than None has its
result stored even when it is None; one annotated ``-> None`` (or not at
all) that returns None stores nothing and costs nothing.

What a caller may rely on:

* :func:`read_result` returns the stored value of a ``done`` job; a ``dead``
  or ``cancelled`` job raises :class:`~sa_jobqueue.JobFailedError` with its
  last error; an unfinished one :class:`~sa_jobqueue.ResultNotReadyError`;
  a job not in the table :class:`~sa_jobqueue.JobNotFoundError`.
* :func:`wait_for_result` blocks until the job finishes, woken by the
  notification as soon as its completion commits, re-reading every
  ``poll_interval`` seconds in case a notification is missed (a job that
  failed for good is seen at the next read), and raises
  :class:`~sa_jobqueue.ResultTimeoutError` after ``timeout``.
* A value that is not JSON fails the attempt (``result: is not JSON
  serializable``), as a bad payload is refused at enqueue. On a table that
  deletes finished jobs a returned value is not stored; the worker logs a
  warning once per task.
* Results are kept as long as their jobs: :meth:`~sa_jobqueue.JobRepository.purge`
  deletes both.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Engine, Table, bindparam, select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY, BIGINT, TEXT
from sqlalchemy.orm import Session

from .channels import results_channel_name
from .checks import INT64_MAX, check_poll_interval, check_session, check_timeout, positive_int
from .errors import InvalidArgumentError, JobFailedError, JobNotFoundError, ResultNotReadyError, ResultTimeoutError
from .payloads import check_payload
from .states import CANCELLED, DEAD, DONE

log = logging.getLogger("sa_jobqueue.worker")

__all__ = [
    "check_wait", "encode_result", "read_result", "result_outcome", "result_to_store", "store_results",
    "wait_for_result",
]

_warned: set[str] = set()
_POSTGRESQL = postgresql.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy leaves it untyped


def encode_result(value: Any) -> str:
    """``value`` as the JSON text the ``result`` column stores; raise naming ``result``."""
    return json.dumps(check_payload(value, parameter="result"), ensure_ascii=False, separators=(",", ":"))


def store_results(session: Session, table: Table, results: Mapping[int, str]) -> None:
    """Store encoded ``results`` (job id to JSON text) of jobs this transaction completes
    on ``table``, and notify its results channel at commit. One statement."""
    if not results:
        return
    session.execute(_store(table), {"ids": list(results), "values": list(results.values()),
                                    "channel": results_channel_name(table.name)})


def _quoted(table: Table) -> str:
    """The table's name as SQL, quoted by PostgreSQL's own rules (with its schema, when it has one)."""
    return _POSTGRESQL.identifier_preparer.format_table(table)


def _store(table: Table) -> Any:
    return text(
        f"WITH stored AS (UPDATE {_quoted(table)} AS t SET result = CAST(r.value AS jsonb) "  # noqa: S608 - identifiers only
        "FROM unnest(:ids, :values) AS r(id, value) WHERE t.id = r.id RETURNING t.id) "
        "SELECT pg_notify(:channel, string_agg(id::text, ',')) FROM stored HAVING count(*) > 0"
    ).bindparams(bindparam("ids", type_=ARRAY(BIGINT)), bindparam("values", type_=ARRAY(TEXT)))


def result_to_store(task: Any, repository: Any, value: Any) -> str | None:
    """What to store for a handler of ``task`` that returned ``value`` on ``repository``'s
    table: the encoded value, or None to store nothing. Raises naming ``result`` when
    the value is not JSON: the attempt's failure."""
    if value is None and not task.returns_result:
        return None
    if not repository.keep_done:
        if value is not None:
            warn_unkept(task.name, repository.table.name)
        return None
    return encode_result(value)


def warn_unkept(task: str, table: str) -> None:
    """A handler returned a value on a table that deletes finished jobs: say so, once per task."""
    if task not in _warned:
        _warned.add(task)
        log.warning("task %s returned a value, but %s does not keep finished jobs (__keep_done__ = True): "
                    "results are not stored there", task, table)


def result_outcome(job_id: int, status: str | None, value: Any, error: str | None, table: str) -> Any:
    """The result a row says: its value when done, else the error :func:`read_result` raises."""
    if status is None:
        raise JobNotFoundError(job_id, table)
    if status == DONE:
        return value
    if status in (DEAD, CANCELLED):
        raise JobFailedError(job_id, status, error)
    raise ResultNotReadyError(job_id, status)


def read_result(session: Session, model: Any, job_id: int) -> Any:
    """The result of job ``job_id`` of ``model``'s table (see the module docstring), in ``session``."""
    session = check_session(session)
    table = _table(model)
    row = session.execute(_read(table), {"id": _job_id(job_id)}).first()
    status, value, error = row if row is not None else (None, None, None)
    return result_outcome(job_id, status, value, error, table.name)


def _read(table: Table) -> Any:
    return select(table.c.status, table.c.result, table.c.last_error).where(table.c.id == bindparam("id"))


def wait_for_result(engine: Engine, model: Any, job_id: int, *, timeout: float, poll_interval: float = 1.0) -> Any:
    """Wait until job ``job_id`` of ``model``'s table finishes and return its result (or raise its error).

    One connection of its own, made as ``engine`` makes them, LISTENs on the
    table's results channel, then reads the row; it reads again on each
    notification naming the job, and every ``poll_interval`` seconds.
    Raises :class:`~sa_jobqueue.ResultTimeoutError` after ``timeout`` seconds.
    """
    from psycopg import sql

    from .connections import own_session, raw_connect

    table, job_id, timeout, poll_interval = check_wait(model, job_id, timeout, poll_interval)
    deadline = time.monotonic() + timeout
    query = f"SELECT status, result, last_error FROM {_quoted(table)} WHERE id = %s"  # noqa: S608 - an identifier
    with raw_connect(engine)() as conn:
        own_session(conn)
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(results_channel_name(table.name))))
        while True:
            row = conn.execute(query, (job_id,)).fetchone()  # type: ignore[arg-type,unused-ignore]  # a quoted name
            status, value, error = row if row is not None else (None, None, None)
            try:
                return result_outcome(job_id, status, value, error, table.name)
            except ResultNotReadyError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResultTimeoutError(job_id, timeout)
            for note in conn.notifies(timeout=min(poll_interval, left)):
                if str(job_id) in note.payload.split(","):
                    break


def check_wait(model: Any, job_id: object, timeout: object, poll_interval: object) -> tuple[Table, int, float, float]:
    """A wait's arguments, checked: the table, the id and the two durations in seconds."""
    return _table(model), _job_id(job_id), _seconds("timeout", timeout), _seconds("poll_interval", poll_interval)


def _table(model: Any) -> Table:
    table = getattr(model, "__table__", None)
    if not isinstance(table, Table) or "result" not in table.c:
        raise InvalidArgumentError("model", f"must be a JobMixin model with a result column, got {model!r}")
    return table


def _job_id(value: object) -> int:
    return positive_int("job_id", value, INT64_MAX)


def _seconds(name: str, value: object) -> float:
    if name == "poll_interval":
        return check_poll_interval(value)
    return check_timeout(name, value).total_seconds()
