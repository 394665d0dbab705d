"""Job snapshots: model instances built from rows a Core statement returned.

The verbs that hand jobs to the caller (enqueue, claim) run Core statements
on the table and return *detached snapshots*: instances of the user's model
holding every mapped column as the statement saw it, with an identity key but
no session. Building one costs a few microseconds, where loading through the
ORM (identity map, loader machinery) costs far more per row, which dominated
a worker's claim and a single enqueue.

What a caller may rely on:

* a snapshot is an instance of the model, with every column attribute set;
* it is detached: it does not track later changes to the row, commits do not
  expire it, and reading it never emits SQL;
* ``session.get(Model, job.id)`` loads the live row; ``session.merge(job)``
  or ``session.add(job)`` attaches the snapshot itself when wanted.

A claim reads the job's JSON columns (the payload, and ``meta``, ``result``
and ``progress`` when not NULL) as JSON text and decodes them here, row by
row (:meth:`Snapshots.decode`), with the JSON decoder the driver would use
(:func:`json_loads`): a row with a value the client cannot decode (nested
deeper than Python's recursion limit, an integer longer than Python
converts) then fails alone, instead of failing the fetch of the whole batch
after the claim took it. It costs less too: psycopg's ``jsonb`` loader took
about 2.2 µs of a fetch per row for an empty ``meta``, ``json.loads`` of its
text takes about 0.75.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import psycopg
from psycopg.pq import Format
from sqlalchemy import JSON, Column, ColumnElement, Connection, Table, Text, cast
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import configure_mappers
from sqlalchemy.orm.attributes import instance_dict, instance_state

M = TypeVar("M")

#: The JSON columns of :class:`~sa_jobqueue.JobMixin` that a claim reads as text and decodes row by row.
JSON_KEYS = ("payload", "result", "meta", "progress")

JsonLoads = Callable[[str], Any]
_JSON_LOADS: JsonLoads = json.loads


def json_loads(connection: Connection) -> JsonLoads:
    """How ``connection``'s driver decodes a ``jsonb`` value, as a function of its JSON text.

    On psycopg 3 (sync or async): the loader the connection itself uses for
    ``jsonb`` (the engine's ``json_deserializer`` when one was given, which
    SQLAlchemy installs there), fed what psycopg feeds it, the text's bytes;
    when that loader is psycopg's default, :func:`json.loads` on the text
    itself (the same result, without the encoding). Other drivers:
    SQLAlchemy's own result processing of a JSON column, which applies the
    engine's ``json_deserializer`` (default :func:`json.loads`) to the text,
    as psycopg2 does; or, where the driver decodes ``jsonb`` itself (asyncpg),
    the ``json_deserializer`` SQLAlchemy gives the driver, which it calls with
    the text.
    """
    raw = connection.connection.driver_connection
    if isinstance(raw, (psycopg.Connection, psycopg.AsyncConnection)):
        jsonb = raw.adapters.types.get("jsonb")
        loader_type = None if jsonb is None else raw.adapters.get_loader(jsonb.oid, Format.TEXT)
        if jsonb is not None and loader_type is not None:
            loader = loader_type(jsonb.oid, raw)
            if getattr(loader, "loads", None) is json.loads:
                return _JSON_LOADS
            load = loader.load
            return lambda text: load(text.encode())
    dialect = connection.dialect
    processor = JSON().result_processor(dialect, None)
    if processor is not None:
        return processor
    # The driver decodes jsonb: with the engine's json_deserializer, installed by SQLAlchemy, if given one.
    return dialect._json_deserializer or _JSON_LOADS


class Snapshots(Generic[M]):
    """Builds detached instances of ``model`` from rows of :attr:`columns`."""

    def __init__(self, model: type[M], table: Table) -> None:
        # Instrumentation is complete only once mappers are configured.
        configure_mappers()
        mapper = sa_inspect(model)
        pairs: list[tuple[str, Column[Any]]] = []
        for prop in mapper.column_attrs:
            column = prop.columns[0]
            if isinstance(column, Column) and column.table is table:
                pairs.append((prop.key, column))
        self._new = mapper.class_manager.new_instance
        # An identity key is (class, primary key tuple, token); its two constant parts, taken from
        # one the mapper built, so that each snapshot's key is a tuple built inline (claims build
        # a hundred at a time).
        sample = mapper.identity_key_from_primary_key((0,))
        self._identity_class, self._identity_token = sample[0], sample[2]
        self.keys: tuple[str, ...] = tuple(key for key, _ in pairs)
        #: The columns to put in RETURNING, in the order rows are read.
        self.columns: tuple[Column[Any], ...] = tuple(column for _, column in pairs)
        # JobMixin's id is the one primary key column.
        self._id_at = self.columns.index(mapper.primary_key[0])
        # The mixin's JSON columns, unless a model gave one a type of its own (whose result
        # processing SQLAlchemy must then do): (attribute, position in a row).
        self._json_at: tuple[tuple[str, int], ...] = tuple(
            (key, at) for at, (key, column) in enumerate(pairs)
            if key in JSON_KEYS and isinstance(column.type, JSON)
        )
        as_text = {at for _, at in self._json_at}
        #: :attr:`columns` with those JSON columns read as their text, for :meth:`decode`.
        self.text_columns: tuple[ColumnElement[Any], ...] = tuple(
            cast(c, Text()).label(c.name) if at in as_text else c for at, c in enumerate(self.columns)
        )

    def one(self, row: Sequence[Any]) -> M:
        """A snapshot of one row of :attr:`columns`."""
        job: M = self._new()
        # zip stops at the last key: a row may carry extra trailing columns (the NOTIFY's).
        instance_dict(job).update(zip(self.keys, row, strict=False))
        # What make_transient_to_detached does for a fully loaded instance
        # with no history (values were written to its dict, not through
        # instrumentation), at a third of its cost: an identity key makes
        # the instance detached rather than transient.
        instance_state(job).key = self._key(row[self._id_at])
        return job

    def of(self, values: dict[str, Any]) -> M:
        """A snapshot from a mapping of attribute name to value (every column)."""
        job: M = self._new()
        instance_dict(job).update(values)
        instance_state(job).key = self._key(values[self.keys[self._id_at]])
        return job

    def _key(self, job_id: Any) -> tuple[Any, ...]:
        """The identity key of the job ``job_id`` (:meth:`decode` builds the same tuple inline)."""
        return (self._identity_class, (job_id,), self._identity_token)

    def all(self, rows: Iterable[Sequence[Any]]) -> list[M]:
        """Snapshots of rows of :attr:`columns`, in the rows' order."""
        return [self.one(row) for row in rows]

    def decode(self, rows: Iterable[Sequence[Any]], loads: JsonLoads) -> tuple[list[M], list[tuple[M, str]]]:
        """Snapshots of rows of :attr:`text_columns`, each JSON value decoded by ``loads``.

        Returns the snapshots of the rows that decode, in the rows' order,
        and apart, per row that does not, its snapshot (with the JSON
        attributes from the one that failed on None) and
        ``"<attribute> cannot be decoded: <ExceptionType>: <message>"``.
        A row that fails never stops the others.
        """
        decoded: list[M] = []
        failed: list[tuple[M, str]] = []
        keys, json_at, id_at = self.keys, self._json_at, self._id_at
        json_keys = [key for key, _ in json_at]
        new, cls, token = self._new, self._identity_class, self._identity_token
        for row in rows:
            job: M = new()
            values = instance_dict(job)
            values.update(zip(keys, row, strict=False))  # as in one(), in C rather than a loop per column
            instance_state(job).key = (cls, (row[id_at],), token)
            key = ""
            try:
                for key, at in json_at:
                    text = row[at]
                    if text is not None:
                        values[key] = loads(text)
            except Exception as exc:  # whatever the decoder raises, this row alone fails
                for later in json_keys[json_keys.index(key):]:
                    values[later] = None  # no text left where a decoded value belongs
                failed.append((job, f"{key} cannot be decoded: {type(exc).__name__}: {exc}"))
                continue
            decoded.append(job)
        return decoded, failed
