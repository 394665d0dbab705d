"""Bulk enqueue through COPY, on the caller's transaction.

``INSERT … RETURNING`` of thousands of rows costs the server an executor
pass per row and the client a parse of every returned column; COPY moves the
same rows several times faster. COPY returns nothing, so the rows' ids are
drawn from the table's identity sequence first, in one statement that also
reads the transaction's ``now()``. Every other column is then known without
reading it back: ``created_at`` defaults to that same ``now()`` (one value per
transaction), ``run_at`` is ``coalesce(run_at, now() + delay)`` as the INSERT
computes it, and the rest are the table's defaults, read from the columns
(:func:`stored_defaults`) and known in Python through the one definition the
mixin renders them from (:data:`~sa_jobqueue.mixin.COLUMN_DEFAULTS`). So the
snapshots built here equal what ``RETURNING`` would have returned.

Used by :meth:`JobRepository.enqueue_many` for rows without a dedupe key
(COPY has no ``ON CONFLICT``), on job tables without columns of the user's
own (whose defaults the client cannot know) and whose job columns keep the
mixin's defaults and types SQLAlchemy sends as they are (:func:`sent_as_is`),
when the session's driver is psycopg 3 (sync or async) or asyncpg
(:mod:`sa_jobqueue.copying`). Anything else
takes the INSERT path. The COPY runs on the session's own connection and
transaction: it commits or rolls back with the caller's writes.
SQLAlchemy's ``before_cursor_execute`` events do not see it. The one-row
INSERT of such a table builds its snapshot the same way (:func:`stored_row`),
from the ``id``, ``created_at`` and ``run_at`` it returns.

:meth:`JobRepository.enqueue_many_fast` wants no snapshot: :func:`stream_new_rows`
leaves the ids to the identity and reads nothing back, so it skips the id
reservation and the snapshots, which cost more than the COPY itself (their
objects also make the interpreter's cyclic garbage collector run over them);
and it checks each spec as the row goes out, so that the client's checks
run while the server stores the rows before (in a SAVEPOINT that a refused
spec rolls back: nothing of the call is written then).

:func:`write_order` decides in which order, and in which statements,
``enqueue_many`` writes its rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import JSON, ColumnElement, Table, TextClause, bindparam, text
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session
from sqlalchemy.types import String, TypeDecorator, UserDefinedType

from .copying import copy_records
from .dedupe import ROW_KEY
from .jsontext import compact_json
from .states import COLUMN_DEFAULTS, NOW_DEFAULTS, server_default

T = TypeVar("T")

# The columns COPY writes; the others take their defaults. ``meta`` only for rows that have one
# (rows are copied in groups of one shape, see write_order): rows without it send what they always sent.
_COPIED = ("id", "task", "queue", "payload", "priority", "run_at", "max_attempts")
_COPIED_META = (*_COPIED, "meta")
_JSON_COPIED = ("payload", "meta")  # sent as their JSON text (compact_json)
# A column defaulting to now(), in stored_defaults(): the transaction's now() once known.
NOW = object()

_RESERVE = text(
    "SELECT now() AS now, array_agg(nextval(CAST(:sequence AS regclass))) AS ids "
    "FROM generate_series(1, :n)"
).bindparams(bindparam("sequence", type_=String()))

_SEQUENCE = text("SELECT pg_get_serial_sequence(:table, 'id')")

_NOW = text("SELECT now()")


# Fewer rows than this go through INSERT: COPY's extra round trip (the id
# reservation) costs more than it saves on a handful of rows.
COPY_THRESHOLD = 16


def write_order(rows: Sequence[dict[str, Any]]) -> list[tuple[bool, list[int]]]:
    """The statements ``enqueue_many`` writes checked ``rows`` with, in order:
    per statement, whether its rows have a dedupe key, and their indexes.

    Rows with a dedupe key come first, sorted by ``(queue, dedupe_key)``
    (repeats in input order), in runs of rows with the same columns and
    ``on_conflict`` (one statement takes rows of one shape). An INSERT meeting a key that another
    transaction wrote but has not committed waits for that transaction; in
    one global order, concurrent calls with overlapping keys wait in line
    behind each other, where in their callers' orders two of them could wait
    for each other (a deadlock). Rows without a key follow, one group per
    shape, in input order: they wait for nobody.
    """
    order: list[tuple[bool, list[int]]] = []
    keyed = sorted(
        (i for i, row in enumerate(rows) if row["dedupe_key"] is not None),
        key=lambda i: (rows[i]["queue"], rows[i]["dedupe_key"]),
    )
    shape: tuple[frozenset[str], str] | None = None
    for i in keyed:
        # One statement per shape and on_conflict: the statements that follow the INSERT differ by it.
        if (frozenset(rows[i]), rows[i][ROW_KEY].on_conflict) != shape:
            shape = (frozenset(rows[i]), rows[i][ROW_KEY].on_conflict)
            order.append((True, []))
        order[-1][1].append(i)
    plain: dict[frozenset[str], list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if row["dedupe_key"] is None:
            plain[frozenset(row)].append(i)
    order.extend((False, indexes) for indexes in plain.values())
    return order


def _default_sql(default: object) -> str:
    """A server default's SQL: a string default as the literal SQLAlchemy renders, else its text."""
    if isinstance(default, str):
        return "'" + default.replace("'", "''") + "'"
    if isinstance(default, TextClause):
        return default.text
    if isinstance(default, ColumnElement):
        return str(default.compile())
    return repr(default)


# What stream_new_rows may leave to the table, in COPY's column order: each column and the SQL its
# default must be (None: no default, NULL) to store what a row at the mixin's default holds.
_LEFT_OUT = {"priority": _default_sql(server_default("priority")), "run_at": "now()", "max_attempts": None}


def _server_default_sql(column: Any) -> str | None:
    """The SQL of ``column``'s server default, or None without one."""
    given = column.server_default
    return None if given is None else _default_sql(getattr(given, "arg", given))


def sent_as_is(table: Table) -> bool:
    """Whether COPY writes what an INSERT would: every column COPY may send has a
    type SQLAlchemy hands to the driver unchanged (``payload`` and ``meta``: a JSON
    type, sent as the JSON text COPY writes). A column of a type with processing of
    its own (a ``TypeDecorator`` that encrypts a payload, a user-defined type) takes
    the INSERT, where SQLAlchemy applies it: COPY would store the value unprocessed.
    Types are read as PostgreSQL's dialect sees them (a variant for it counts)."""
    make: Callable[[], Dialect] = psycopg_dialect.dialect  # PostgreSQL's types and variants: any of its drivers'
    dialect = make()
    for key in _COPIED_META:
        if key not in table.c:
            continue
        kind = table.c[key].type.dialect_impl(dialect)
        if isinstance(kind, (TypeDecorator, UserDefinedType)):
            return False
        if key in _JSON_COPIED:
            if not isinstance(kind, JSON):
                return False
        elif kind.bind_processor(dialect) is not None:
            return False
    return True


def stored_defaults(table: Table) -> dict[str, Any] | None:
    """What a row written by COPY stores in each column COPY leaves out: NULL
    (None) without a default, :data:`NOW` for ``now()``, else the value of
    :data:`~sa_jobqueue.mixin.COLUMN_DEFAULTS` whose rendering the column's
    server default is. None when a column has any other default (a model
    overriding a job column, or a default computed in Python): only an
    INSERT applies that, so such a table never takes the COPY path."""
    defaults: dict[str, Any] = {}
    for column in table.columns:
        if column.key in _COPIED:
            continue
        if column.default is not None:
            return None
        sql_text = _server_default_sql(column)
        if sql_text is None:
            defaults[column.key] = None
            continue
        if column.key in NOW_DEFAULTS and sql_text == "now()":
            defaults[column.key] = NOW
        elif column.key in COLUMN_DEFAULTS and sql_text == _default_sql(server_default(column.key)):
            defaults[column.key] = COLUMN_DEFAULTS[column.key]
        else:
            return None
    return defaults


def left_out_values(defaults: dict[str, Any], now: datetime) -> dict[str, Any]:
    """What the columns a row was written without store (its table's :func:`stored_defaults`,
    ``defaults``), ``now`` being the transaction's ``now()``."""
    return {key: now if value is NOW else value for key, value in defaults.items()}


def stored_row(left_out: dict[str, Any], job_id: int, row: dict[str, Any], run_at: datetime,
               payload: Any) -> dict[str, Any]:
    """Every column's value as stored for the checked ``row`` written with id ``job_id``, as
    ``run_at`` (the server's ``coalesce(run_at, now() + delay)``), its payload read back as ``payload``;
    ``left_out``: :func:`left_out_values`. A row's ``meta`` is the caller's to add."""
    return {**left_out, "id": job_id, "task": row["task"], "queue": row["queue"], "payload": payload,
            "priority": row["priority"], "run_at": run_at, "max_attempts": row["max_attempts"]}


def sequence_of(session: Session, table: Table) -> str:
    """The identity sequence behind ``table.id``, schema-qualified and quoted."""
    name = session.connection().dialect.identifier_preparer.format_table(table)
    sequence = session.execute(_SEQUENCE, {"table": name}).scalar_one()
    if sequence is None:
        raise LookupError(f"{table.name}.id has no identity sequence")
    return str(sequence)


def copy_rows(
    session: Session, conn: Any, table: Table, sequence: str, rows: Sequence[dict[str, Any]],
    defaults: dict[str, Any], snapshot: Callable[[dict[str, Any]], T], loads: Callable[[str], Any],
    payload_texts: Sequence[str] | None = None,
) -> list[T]:
    """COPY checked rows (from :func:`~sa_jobqueue.spec.to_row`) into ``table``,
    whose :func:`stored_defaults` are ``defaults``, on ``conn``
    (:func:`~sa_jobqueue.copying.copy_connection` of ``session``).

    Return, per row in input order, ``snapshot`` of every column's value as stored (a
    mapping of its own, which ``snapshot`` may keep), its JSON columns read back from
    their text by ``loads`` (:func:`~sa_jobqueue.snapshot.json_loads`: as the driver reads them).
    ``payload_texts``: per row, its payload's :func:`~sa_jobqueue.jsontext.compact_json` if
    its check made it already (sent as is: the payload is not encoded a second time).
    """
    reserved = session.execute(_RESERVE, {"sequence": sequence, "n": len(rows)}).one()
    now: datetime = reserved.now
    ids: list[int] = sorted(reserved.ids)
    left_out = left_out_values(defaults, now)
    with_meta = "meta" in rows[0]
    # Snapshots as the rows go out: no mapping per row outlives its row (a bulk enqueue's
    # cost is in good part the cyclic garbage collector's passes over what it keeps).
    made: list[T] = []

    def records() -> Iterator[tuple[Any, ...]]:
        # One pass, as the driver writes: each row's stored values are known as it goes out.
        texts = payload_texts if payload_texts is not None else (compact_json(row["payload"]) for row in rows)
        for job_id, row, encoded in zip(ids, rows, texts, strict=True):
            delay: timedelta | None = row["delay"]
            run_at = row["run_at"] or (now + delay if delay else now)
            # As read back from jsonb: tuples become lists, keys strings.
            values = stored_row(left_out, job_id, row, run_at, loads(encoded))
            record: tuple[Any, ...] = (
                job_id, row["task"], row["queue"], encoded, row["priority"], run_at, row["max_attempts"])
            if with_meta:
                meta = compact_json(row["meta"])
                values["meta"] = loads(meta)
                record = (*record, meta)
            made.append(snapshot(values))
            yield record

    copy_records(conn, table, _COPIED_META if with_meta else _COPIED, records())
    return made


def omissible(table: Table) -> frozenset[str]:
    """The columns among ``priority``, ``run_at`` and ``max_attempts`` that :func:`stream_new_rows`
    may leave out of a COPY whose rows all hold its default (0, the transaction's ``now()``,
    NULL): those whose default on ``table`` stores exactly that."""
    return frozenset(key for key, sql_text in _LEFT_OUT.items()
                     if table.columns[key].default is None and _server_default_sql(table.columns[key]) == sql_text)


def stream_new_rows(session: Session, conn: Any, table: Table, specs: Sequence[Any],
                    check: Callable[[Any], tuple[dict[str, Any], str]], omissible: frozenset[str],
                    plain: Callable[[Any], tuple[str, str, str] | None]) -> None:
    """COPY ``specs`` (:class:`~sa_jobqueue.JobSpec` without dedupe keys) into ``table`` on
    ``conn`` (:func:`~sa_jobqueue.copying.copy_connection`), each checked by ``check`` (its
    checked row and its payload's JSON text, :func:`~sa_jobqueue.jsontext.compact_json`) as it
    goes out, while the server stores the rows sent before it. They are written as
    :func:`copy_rows` writes them, but with the ids left to the table's identity and nothing
    known of them afterwards: no id reservation, no snapshot; and a column of ``omissible``
    (:func:`omissible`) that every spec leaves at its default is not sent either, as the raw
    COPY of a loader would not. Where no such column is sent, each spec goes to ``plain``
    first (:func:`~sa_jobqueue.spec.plain_fields`: its task, queue and payload text, checked,
    or None for ``check`` to decide). A spec that ``check`` or ``plain`` refuses ends the COPY
    with its error, some rows sent: the caller runs this in a SAVEPOINT and rolls back to it
    then."""
    set_by_specs = {"priority": any(spec.priority != COLUMN_DEFAULTS["priority"] for spec in specs),
                    "run_at": any(spec.run_at is not None or spec.delay is not None for spec in specs),
                    "max_attempts": any(spec.max_attempts is not None for spec in specs)}
    sent = [key for key in _LEFT_OUT if key not in omissible or set_by_specs[key]]
    priority, run_at_sent, limit = "priority" in sent, "run_at" in sent, "max_attempts" in sent
    meta = any(spec.meta is not None for spec in specs)
    now: datetime | None = None
    if run_at_sent and any(spec.run_at is None for spec in specs):
        now = session.execute(_NOW).scalar_one()

    def records() -> Iterator[tuple[Any, ...]]:
        if not (priority or run_at_sent or limit or meta):  # rows at every default, as most bulk loads
            for spec in specs:
                fields = plain(spec)
                if fields is None:  # a field set in a way the plain check does not take (extra, a bool priority)
                    row, payload = check(spec)
                    fields = row["task"], row["queue"], payload
                yield fields
            return
        for row, payload in (check(spec) for spec in specs):
            record = [row["task"], row["queue"], payload]
            if priority:
                record.append(row["priority"])
            if run_at_sent:
                run_at: datetime | None = row["run_at"]
                if run_at is None:  # coalesce(run_at, now() + delay), as the INSERT computes it
                    assert now is not None
                    delay: timedelta | None = row["delay"]
                    run_at = now + delay if delay else now
                record.append(run_at)
            if limit:
                record.append(row["max_attempts"])
            if meta:
                given = row.get("meta")
                record.append(None if given is None else compact_json(given))
            yield tuple(record)

    copy_records(conn, table, ["task", "queue", "payload", *sent, *(["meta"] if meta else [])], records())
