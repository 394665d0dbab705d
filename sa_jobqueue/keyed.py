"""The statements of keyed enqueues (:mod:`sa_jobqueue.dedupe`) besides the INSERT.

The INSERT of keyed rows (``ON CONFLICT DO NOTHING`` on the partial unique
index, :func:`sa_jobqueue.statements.insert_jobs`) never locks a row it meets.
What follows it for the rows it skipped is here: :func:`take_over` changes a
pending holder (``replace``, ``debounce``), :func:`live_holders` reads the
holders left as they are, and :func:`done_holder` finds the finished job that
holds a key within a dedupe window (whose new row :func:`discard` removes).

``take_over`` matches pending rows only, so it never waits on a running
job's row (and a worker's heartbeat and completion of that job never wait on
the enqueueing transaction); it locks the pending holder it changes until the
caller commits, which a claim skips (``SKIP LOCKED``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    DateTime,
    Delete,
    Interval,
    Select,
    String,
    Table,
    Update,
    bindparam,
    delete,
    func,
    literal_column,
    select,
    update,
)

from .states import DONE, LIVE_STATUSES, PENDING


def live_holders(model: Any, columns: Sequence[Any], queues: Sequence[str], keys: Sequence[str]) -> Select[Any]:
    """The live jobs holding any of the given ``(queue, dedupe_key)`` pairs (a superset)."""
    t: Table = model.__table__
    return select(*columns).where(
        t.c.queue.in_(set(queues)),
        t.c.dedupe_key.in_(set(keys)),
        t.c.status.in_(LIVE_STATUSES),
    )


def take_over(model: Any, columns: Sequence[Any], *, debounce: bool) -> Update:
    """Change the pending job holding ``(sajq_queue, sajq_key)`` and return it (no row: none is pending).

    ``replace``: its payload and run_at become ``sajq_payload`` and
    ``coalesce(sajq_run_at, now() + sajq_delay)`` (as an INSERT computes
    run_at). ``debounce``: its run_at becomes the later of its own and that.
    """
    t: Table = model.__table__
    run_at = func.coalesce(
        bindparam("sajq_run_at", type_=DateTime(timezone=True)), func.now() + bindparam("sajq_delay", type_=Interval())
    )
    values: dict[str, Any] = (
        {"run_at": func.greatest(t.c.run_at, run_at)} if debounce
        else {"payload": bindparam("sajq_payload", type_=t.c.payload.type), "run_at": run_at}
    )
    return (
        update(t)
        .where(
            t.c.queue == bindparam("sajq_queue", type_=String()),
            t.c.dedupe_key == bindparam("sajq_key", type_=String()),
            t.c.status == PENDING,
        )
        .values(**values)
        .returning(*columns)
    )


def done_holder(model: Any, columns: Sequence[Any]) -> Select[Any]:
    """The latest ``done`` job of ``(sajq_queue, sajq_key)`` enqueued less than ``sajq_window`` ago
    (database clock), through ``ix_<table>_dedupe_done_v1``."""
    t: Table = model.__table__
    return (
        select(*columns)
        .where(
            t.c.queue == bindparam("sajq_queue", type_=String()),
            t.c.dedupe_key == bindparam("sajq_key", type_=String()),
            # A literal, as in the index predicate: a generic plan still proves the partial index usable.
            t.c.status == literal_column(f"'{DONE}'"),
            t.c.created_at > func.now() - bindparam("sajq_window", type_=Interval()),
        )
        .order_by(t.c.created_at.desc())
        .limit(1)
    )


def discard(model: Any) -> Delete:
    """Delete the job ``sajq_id`` (one this transaction inserted, that a done holder outranks)."""
    t: Table = model.__table__
    return delete(t).where(t.c.id == bindparam("sajq_id"))


def take_over_params(row: dict[str, Any]) -> dict[str, Any]:
    """:func:`take_over`'s parameters for a checked row."""
    return {
        "sajq_queue": row["queue"], "sajq_key": row["dedupe_key"], "sajq_payload": row["payload"],
        "sajq_run_at": row["run_at"], "sajq_delay": row["delay"],
    }


__all__ = ["discard", "done_holder", "live_holders", "take_over", "take_over_params"]
