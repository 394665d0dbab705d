"""Building and dropping a job table's indexes from a revision, CONCURRENTLY unless told otherwise.

The steps under the index helpers of :mod:`sa_jobqueue.migrations`: call them
inside a revision, where ``alembic.op`` is live. :func:`build_index` builds an
index (``CREATE INDEX CONCURRENTLY`` in an autocommit block, so workers keep
claiming and enqueueing while it builds), then drops the index it replaces,
if any; :func:`drop_index` drops one. Online, an index left INVALID by an
earlier failed concurrent build is dropped and built again, and a valid one
is kept, so a failed step can be run again.
"""

from __future__ import annotations

from alembic import op

from .ddl import index_valid, qualified, quote
from .errors import InvalidArgumentError

CALLERS_TRANSACTION = "sa_jobqueue_callers_transaction"
"""The ``context.configure`` option by which an ``env.py`` says that the
migrations run inside a transaction its caller began (a connection handed over
in ``config.attributes["connection"]`` after ``begin()``). sa_jobqueue's own
``env.py`` sets it; the index helpers then build in that transaction."""


def check_concurrently(concurrently: object) -> bool:
    """``concurrently`` as given, or when None: unless the caller's transaction holds the revision."""
    if concurrently is None:
        return not op.get_context().opts.get(CALLERS_TRANSACTION, False)
    if not isinstance(concurrently, bool):
        raise InvalidArgumentError("concurrently", f"expected True, False or None, got {concurrently!r}")
    return concurrently


def build_index(
    table: str, schema: str | None, concurrently: bool, *, build: str, columns: tuple[str, ...],
    where: str | None, drop: str | None = None,
) -> None:
    """Build index ``build`` on ``table`` (``columns``, partial on ``where`` unless None), then drop ``drop``.

    The names must have been checked (:func:`sa_jobqueue.ddl.check_name`)."""
    how = " CONCURRENTLY" if concurrently else ""
    create = (
        f"CREATE INDEX{how} {quote(build)} ON {qualified(table, schema)} "
        f"({', '.join(quote(c) for c in columns)})" + ("" if where is None else f" WHERE {where}")
    )

    def run() -> None:
        valid = index_valid(build, schema)
        if valid is False:  # left INVALID by a failed concurrent build
            op.execute(f"DROP INDEX{how} {qualified(build, schema)}")
        if valid is not True:
            op.execute(create)
        if drop is not None:
            op.execute(f"DROP INDEX{how} IF EXISTS {qualified(drop, schema)}")

    if concurrently:
        with op.get_context().autocommit_block():
            run()
    else:
        run()


def drop_index(name: str, schema: str | None, concurrently: bool) -> None:
    """``DROP INDEX [CONCURRENTLY] IF EXISTS name`` (a checked name), in an autocommit block when concurrent."""
    how = " CONCURRENTLY" if concurrently else ""
    statement = f"DROP INDEX{how} IF EXISTS {qualified(name, schema)}"
    if concurrently:
        with op.get_context().autocommit_block():
            op.execute(statement)
    else:
        op.execute(statement)


__all__ = ["CALLERS_TRANSACTION", "build_index", "check_concurrently", "drop_index"]
