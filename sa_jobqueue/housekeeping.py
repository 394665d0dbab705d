"""The housekeeping statements: reap, cancel, retry, purge, stats.

As :mod:`sa_jobqueue.statements` (whose fences and status literals they
share), functions of the mapped job model returning Core constructs that
:class:`~sa_jobqueue.JobRepository` executes. None of them is on a job's hot
path: an operator, a script or a worker's reaper runs them now and then.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    Delete,
    Integer,
    Interval,
    Select,
    String,
    Table,
    Text,
    Update,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB

from .statements import PENDING_LITERAL, RUNNING_LITERAL, attempts_limit, cancel_requested, released
from .states import CANCELLED, DEAD, PENDING, RUNNING


def reap(model: Any) -> Update:
    """Return running jobs whose lease expired to pending, or to dead when out of
    attempts, or to cancelled when a cancel of them was requested.

    The expired rows are locked with SKIP LOCKED in a CTE, so several workers
    may reap at once: each row is reaped by one of them, and a job whose
    worker is finishing it right now (row locked) is left alone.
    Parameters: ``limit``, and ``task_limits``: a JSON object of task name to
    max attempts, the limit of the jobs of those tasks enqueued without one
    (:func:`attempts_limit`; a worker passes its tasks' own limits, so a
    crash-looping job dies by the same rule as a failing one).
    """
    t: Table = model.__table__
    expired = (
        select(t.c.id)
        .where(t.c.status == RUNNING_LITERAL, t.c.lease_expires_at < func.now())
        .order_by(t.c.lease_expires_at)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)
        .cte("expired")
    )
    task_limit = bindparam("task_limits", type_=JSONB()).op("->>")(t.c.task)
    dead = t.c.attempts >= attempts_limit(t, cast(task_limit, Integer()))
    return (
        update(t)
        .where(t.c.id == expired.c.id)
        .values(
            status=case((cancel_requested(t), CANCELLED), (dead, DEAD), else_=PENDING),
            # run_at is kept: a crashed attempt's job goes back to its place
            # in the queue, not behind the whole backlog.
            finished_at=case((or_(dead, cancel_requested(t)), func.now()), else_=None),
            last_error=func.concat(
                case((cancel_requested(t), "cancelled while running: "), else_=""),
                "lease expired at attempt ", t.c.attempts, " (worker ",
                func.coalesce(t.c.locked_by, "unknown"), ")",
            ),
            **released(),
        )
        .returning(t.c.id, t.c.status)
    )


def cancel(model: Any) -> Update:
    """Cancel a pending job at once, or request the cancel of a running one.

    A pending job becomes ``cancelled``. A running job stays running with
    ``cancel_requested_at`` set (the first request's time is kept), and the
    statement sends ``pg_notify(:cancel_channel, id)`` so that a listening
    worker learns of it at once; NOTIFY is transactional, so it is heard
    when the caller commits. Returns the id and the new status; no row when
    the job is neither pending nor running. Parameters: ``job_id``,
    ``cancel_channel``.
    """
    t: Table = model.__table__
    pending = t.c.status == PENDING_LITERAL
    notify = func.pg_notify(bindparam("cancel_channel", type_=String()), cast(t.c.id, Text()))
    return (
        update(t)
        .where(t.c.id == bindparam("job_id"), t.c.status.in_((PENDING, RUNNING)))
        .values(
            status=case((pending, CANCELLED), else_=t.c.status),
            finished_at=case((pending, func.now()), else_=t.c.finished_at),
            cancel_requested_at=case(
                (pending, t.c.cancel_requested_at), else_=func.coalesce(t.c.cancel_requested_at, func.now())
            ),
        )
        # In RETURNING, status is the new one: still running means requested.
        .returning(t.c.id, t.c.status, case((t.c.status == RUNNING_LITERAL, notify)).label("notified"))
    )


def retry(model: Any) -> Update:
    """Send a dead or cancelled job back to pending, runnable now.

    Attempts are kept (history). A job enqueued with a limit has its
    ``max_attempts`` raised to ``attempts + 1`` when needed; one enqueued
    without keeps none (NULL), so its task's limit still applies. Either way
    the job gets one more attempt: the claim counts and hands out an attempt
    whatever the limit, and only a failure after it compares attempts with
    the limit. A cancel request of an earlier run is cleared: the new run
    starts without one. A job whose dedupe key is held by another live job
    stays as it is (the statement matches no row). Parameter: ``job_id``.
    """
    t: Table = model.__table__
    holder = t.alias("holder")
    key_taken = (
        select(holder.c.id)
        .where(
            holder.c.queue == t.c.queue,
            holder.c.dedupe_key == t.c.dedupe_key,
            holder.c.status.in_((PENDING, RUNNING)),
        )
        .exists()
    )
    return (
        update(t)
        .where(t.c.id == bindparam("job_id"), t.c.status.in_((DEAD, CANCELLED)), ~key_taken)
        .values(
            status=PENDING,
            run_at=func.now(),
            finished_at=None,
            cancel_requested_at=None,
            max_attempts=case(
                (t.c.max_attempts.is_not(None), func.greatest(t.c.max_attempts, t.c.attempts + 1)), else_=None
            ),
        )
        .returning(t.c.id)
    )


def purge(model: Any, *, statuses: Sequence[str], older_than: timedelta, limit: int) -> Delete:
    """Delete up to ``limit`` finished jobs older than ``older_than``, in one bounded batch."""
    t: Table = model.__table__
    batch = (
        select(t.c.id)
        .where(
            t.c.status.in_(list(statuses)),
            t.c.finished_at < func.now() - bindparam("older_than", older_than, type_=Interval()),
        )
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return delete(t).where(t.c.id == any_(func.array(batch.scalar_subquery())))


def stats(model: Any) -> Select[Any]:
    """Jobs per queue and status, with the age of the oldest runnable job."""
    t: Table = model.__table__
    runnable = and_(t.c.status == PENDING, t.c.run_at <= func.now())
    return (
        select(
            t.c.queue,
            t.c.status,
            func.count().label("count"),
            func.max(func.now() - t.c.run_at).filter(runnable).label("oldest_runnable_age"),
        )
        .group_by(t.c.queue, t.c.status)
        .order_by(t.c.queue, t.c.status)
    )
