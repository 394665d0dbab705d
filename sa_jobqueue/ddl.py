"""Checked SQL identifiers and catalog lookups for the Alembic helpers of
:mod:`sa_jobqueue.migrations`.

Call them inside a revision, where ``alembic.op`` is live. A name passes only
as a plain identifier (letters, digits, underscores, at most 63 bytes), so a
caller cannot change a statement's meaning through one; the lookups read the
catalog online and answer "unknown" offline (``--sql``), where there is no
database to ask.
"""

from __future__ import annotations

import re

from sqlalchemy import text

from alembic import op

from .errors import InvalidArgumentError
from .mixin import MAX_IDENTIFIER_BYTES

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_name(parameter: str, value: object) -> str:
    """``value`` if it is a plain identifier that fits; else InvalidArgumentError naming ``parameter``."""
    if not isinstance(value, str) or not NAME.match(value):
        raise InvalidArgumentError(
            parameter,
            f"expected a plain SQL identifier (letters, digits, underscores), got {value!r}",
        )
    if len(value.encode()) > MAX_IDENTIFIER_BYTES:
        raise InvalidArgumentError(
            parameter, f"{value!r} is longer than PostgreSQL's {MAX_IDENTIFIER_BYTES} bytes"
        )
    return value


def check_schema(schema: object) -> str | None:
    """``schema`` checked as :func:`check_name`; None stays None (the search path)."""
    return None if schema is None else check_name("schema", schema)


def quote(name: str) -> str:
    """``name`` quoted by the migration's dialect where PostgreSQL needs it."""
    return op.get_context().dialect.identifier_preparer.quote(name)


def qualified(name: str, schema: str | None) -> str:
    """``schema.name``, each part quoted; ``name`` alone when no schema is given."""
    return quote(name) if schema is None else f"{quote(schema)}.{quote(name)}"


def relkind(name: str, schema: str | None) -> str | None:
    """Online: the pg_class relkind of ``name`` (None when absent). Offline: "?"."""
    context = op.get_context()
    if context.as_sql:
        return "?"
    row = op.get_bind().execute(
        text("SELECT c.relkind FROM pg_catalog.pg_class c WHERE c.oid = to_regclass(:name)"),
        {"name": qualified(name, schema)},
    ).first()
    return None if row is None else str(row[0])


def require_table(parameter: str, name: str, schema: str | None) -> None:
    """Online: raise InvalidArgumentError naming ``parameter`` unless ``name`` is a table."""
    kind = relkind(name, schema)
    where = f"schema {schema!r}" if schema is not None else "the search path"
    if kind is None:
        raise InvalidArgumentError(parameter, f"no table {name!r} in {where}")
    if kind not in ("r", "p", "?"):
        raise InvalidArgumentError(parameter, f"{name!r} in {where} is not a table (relkind {kind!r})")


def require_absent(parameter: str, name: str, schema: str | None) -> None:
    """Online: raise InvalidArgumentError naming ``parameter`` if a relation ``name`` exists."""
    if relkind(name, schema) not in (None, "?"):
        where = f"schema {schema!r}" if schema is not None else "the search path"
        raise InvalidArgumentError(parameter, f"a relation named {name!r} already exists in {where}")


def index_valid(name: str, schema: str | None) -> bool | None:
    """Online: whether index ``name`` is valid (None when absent). Offline: None."""
    if op.get_context().as_sql:
        return None
    row = op.get_bind().execute(
        text("SELECT i.indisvalid FROM pg_catalog.pg_index i WHERE i.indexrelid = to_regclass(:name)"),
        {"name": qualified(name, schema)},
    ).first()
    return None if row is None else bool(row[0])
