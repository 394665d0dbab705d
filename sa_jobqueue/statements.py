"""The statements of a job's way through the queue, as functions returning SQLAlchemy constructs.

Insert, claim, then the fenced writes of the claim's owner (complete, fail,
heartbeat, hand back, mark cancelled, bury), and the NOTIFY of an enqueue;
the fences and the status literals here are shared with the housekeeping
statements (:mod:`sa_jobqueue.housekeeping`: reap, cancel, retry, purge,
stats). Nothing here runs anything: :mod:`sa_jobqueue.repository` executes
these on a session it is given, and the tests compile them to check their
shape. Each function takes the mapped job model. All are Core statements on the table:
the ORM's bulk-DML bookkeeping and loading cost more than the statement on
the hot paths. The verbs that hand jobs back (insert, claim) add the
snapshot columns to RETURNING (:mod:`sa_jobqueue.snapshot`); the claim reads
the payload as JSON text, decoded row by row there.

Literal status values (not bound parameters) appear wherever a partial index
must match: a generic plan of a prepared statement cannot prove that
``status = $1`` implies the index predicate ``status = 'pending'``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    Delete,
    Integer,
    Interval,
    Select,
    String,
    Table,
    Text,
    TextClause,
    Update,
    and_,
    any_,
    bindparam,
    case,
    column,
    delete,
    func,
    literal_column,
    null,
    or_,
    select,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import Insert, insert
from sqlalchemy.types import Boolean, DateTime, Uuid

from .states import (
    CANCELLED,
    DEAD,
    DEDUPE_PREDICATE,
    DEFAULT_MAX_ATTEMPTS,
    DONE,
    PENDING,
    RELEASED_AT_START,
    RUNNING,
)

# The statuses as SQL literals, for predicates a partial index must match.
PENDING_LITERAL: ColumnElement[str] = literal_column(f"'{PENDING}'")
RUNNING_LITERAL: ColumnElement[str] = literal_column(f"'{RUNNING}'")


def released() -> dict[str, Any]:
    """The columns a fail, a hand back or a reap clears: the job is no longer owned."""
    return {"locked_at": None, "locked_by": None, "lease_expires_at": None, "lock_token": None}


def _owned_many(t: Table) -> Any:
    """The fence of a list of claimed jobs (parameters ``ids`` and ``tokens``):
    lock tokens are unique per claim, so ``lock_token = ANY(tokens)`` pins
    each row to its own claim."""
    return and_(
        t.c.id == any_(bindparam("ids", type_=ARRAY(t.c.id.type))),
        t.c.lock_token == any_(bindparam("tokens", type_=ARRAY(Uuid()))),
        t.c.status == RUNNING_LITERAL,
    )


def attempts_limit(t: Table, task_limit: ColumnElement[Any]) -> ColumnElement[int]:
    """The most attempts a job gets: the limit given at enqueue (the row's
    ``max_attempts``), else its task's (``task_limit``, NULL when the task has
    none), else :data:`~sa_jobqueue.mixin.DEFAULT_MAX_ATTEMPTS`. An explicit
    limit on the job wins, as in Oban and River."""
    return func.coalesce(t.c.max_attempts, task_limit, literal_column(str(DEFAULT_MAX_ATTEMPTS), Integer()))


def cancel_requested(t: Table) -> Any:
    """A cancel was asked for while the job ran (see :func:`sa_jobqueue.housekeeping.cancel`)."""
    return t.c.cancel_requested_at.is_not(None)


def insert_jobs(model: Any, *, dedupe: bool) -> Insert:
    """INSERT of job rows, executed with a list of parameter dicts.

    ``run_at`` is ``coalesce(:run_at, now() + :delay)`` so that a delay is
    measured on the database's clock, the same clock the claim compares to.
    With ``dedupe`` the statement skips rows whose ``(queue, dedupe_key)``
    belongs to a live job (``ON CONFLICT DO NOTHING`` on the partial unique
    index); the caller then looks those jobs up.
    """
    t: Table = model.__table__
    stmt = insert(t).values(
        run_at=func.coalesce(
            bindparam("run_at", type_=DateTime(timezone=True)),
            func.now() + bindparam("delay", type_=Interval()),
        )
    )
    if dedupe:
        stmt = stmt.on_conflict_do_nothing(
            index_elements=["queue", "dedupe_key"], index_where=text(DEDUPE_PREDICATE)
        )
    return stmt


def queue_keys(count: int) -> list[str]:
    """The parameter names of the queues of :func:`claim` for ``count`` queues."""
    return [f"queue_{n}" for n in range(count)]


def limit_bound(limit: int) -> int:
    """The bound :func:`claim` is built with for a claim of ``limit`` jobs: the
    power of two at or above it, so that a worker asking for 1 to 100 jobs
    uses at most eight statements."""
    return 1 << (limit - 1).bit_length()


def claim(model: Any, queue_count: int = 1, bound: int = 1) -> Update:
    """Claim up to ``limit`` (at most ``bound``) runnable jobs from ``queue_count`` queues in one statement.

    Shape (docs/concepts.md, "The claim", says why each part is there): a
    CTE holds every ``FOR UPDATE SKIP LOCKED`` and ``LIMIT``, so the locking
    scans run once. Each queue is its own subquery (UNION ALL when several);
    in it a recursive CTE steps through the pending priorities, one descent
    of the claim index each, and each priority's runnable rows are read in
    ``(run_at, id)`` order up to the first not yet due. One queue's rows come
    out in claim order and the claim locks only ``limit`` of them; several
    queues lock up to ``bound`` rows each and are merged by ``(priority,
    run_at, id)``. The plan is the same whether PostgreSQL plans it with the
    values or generically: ``bound`` is a number in the statement (a generic
    ``LIMIT $n`` over the table is estimated at a tenth of it), each queue a
    parameter of its own (``unnest($1)`` is counted as 10 rows generically, 1
    with the values), and the UPDATE finds the rows by primary key.

    Parameters: ``queue_0`` … (:func:`queue_keys`), ``limit`` (at most
    ``bound``: :func:`limit_bound`), ``worker``, ``lease`` (timedelta). The
    caller adds the columns it wants to RETURNING.
    """
    t: Table = model.__table__
    parts = [_claim_one_queue(t, key, n, bound) for n, key in enumerate(queue_keys(queue_count))]
    if len(parts) == 1:
        # Already in claim order: the LIMIT stops the locking scan at ``limit`` rows.
        merged = parts[0].subquery("per_queue")
        picked = select(merged.c.id).limit(bindparam("limit")).cte("picked")
    else:
        merged = union_all(*parts).subquery("per_queue")
        picked = (
            select(merged.c.id)
            .order_by(merged.c.priority, merged.c.run_at, merged.c.id)
            .limit(bindparam("limit"))
            .cte("picked")
        )
    # ``id = ANY(ARRAY(SELECT id FROM picked))``: the primary key's index,
    # whatever the planner guesses of picked's size (a join to picked turns
    # into a hash join over the whole table once it expects a hundred rows).
    picked_ids = func.array(select(picked.c.id).scalar_subquery(), type_=ARRAY(BigInteger()))
    return (
        update(t)
        .where(t.c.id == any_(picked_ids))
        .values(
            status=RUNNING,
            attempts=t.c.attempts + 1,
            locked_at=func.now(),
            locked_by=bindparam("worker"),
            lease_expires_at=func.now() + bindparam("lease", type_=Interval()),
            lock_token=func.gen_random_uuid(),
            # A key held until the job starts is given up as it starts (sa_jobqueue.dedupe).
            dedupe_key=case((t.c.dedupe_until == RELEASED_AT_START, None), else_=t.c.dedupe_key),
            progress=null(),  # SQL NULL, not JSON null: an attempt reports its own progress (sa_jobqueue.progress)
        )
    )


def _claim_one_queue(t: Table, key: str, n: int, limit: int) -> Select[Any]:
    """The first ``limit`` runnable jobs of the queue named by parameter
    ``key``, in claim order, locked as they are read: ``(id, priority, run_at)``."""
    pending = and_(t.c.status == PENDING_LITERAL, t.c.queue == bindparam(key, type_=String()))

    def lowest_priority(*after: Any, outer: tuple[Any, ...] = ()) -> Any:
        # min() over an index prefix is one descent (PostgreSQL's min/max rewrite).
        return select(func.min(t.c.priority)).where(pending, *after).correlate(*outer).scalar_subquery()

    priorities = select(lowest_priority().label("priority")).cte(f"priorities_{n}", recursive=True, nesting=True)
    priorities = priorities.union_all(
        select(lowest_priority(t.c.priority > priorities.c.priority, outer=(priorities,)))
        .where(priorities.c.priority.is_not(None))
    )
    due = (
        select(t.c.id, t.c.priority, t.c.run_at)
        .where(pending, t.c.priority == priorities.c.priority, t.c.run_at <= func.now())
        .order_by(t.c.run_at, t.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .correlate(priorities)
        .lateral(f"due_{n}")
    )
    # The recursive CTE yields priorities in ascending order, so the first
    # ``limit`` rows of this join are the queue's first in claim order.
    part = select(due).select_from(priorities).join(due, true()).limit(limit)
    return part


def _owned(t: Table) -> Any:
    """The fence: the row is still running under the caller's claim
    (parameters ``job_id`` and ``token``)."""
    return and_(
        t.c.id == bindparam("job_id"),
        t.c.lock_token == bindparam("token", type_=Uuid()),
        t.c.status == RUNNING_LITERAL,
    )


def complete(model: Any, *, keep_done: bool) -> Update | Delete:
    """Finish a claimed job: delete it, or keep it as ``done``. Fenced."""
    t: Table = model.__table__
    if not keep_done:
        return delete(t).where(_owned(t)).returning(t.c.id)
    return (
        update(t)
        .where(_owned(t))
        .values(status=DONE, finished_at=func.now(), lease_expires_at=None, lock_token=None)
        .returning(t.c.id)
    )


def fail(model: Any) -> Update:
    """Record a failed attempt: back to pending at the retry time, or dead. Fenced.

    The job is dead when ``discard`` is set or its attempts reached its
    limit (:func:`attempts_limit`: the row's ``max_attempts``, else
    ``task_limit``, else the default). The decision is taken in the statement
    from the row's current attempts. A job whose cancel was requested while
    it ran is ``cancelled`` instead, retry or not. Parameters: ``job_id``,
    ``token``, ``error``, ``delay``, ``at``, ``task_limit`` (or None),
    ``discard``.
    """
    t: Table = model.__table__
    limit = attempts_limit(t, bindparam("task_limit", type_=Integer()))
    dead = or_(bindparam("discard", type_=Boolean()), t.c.attempts >= limit)
    ends = or_(dead, cancel_requested(t))
    return (
        update(t)
        .where(_owned(t))
        .values(
            status=case((cancel_requested(t), CANCELLED), (dead, DEAD), else_=PENDING),
            run_at=case(
                (ends, t.c.run_at),
                else_=func.coalesce(
                    bindparam("at", type_=DateTime(timezone=True)),
                    func.now() + bindparam("delay", type_=Interval()),
                ),
            ),
            finished_at=case((ends, func.now()), else_=None),
            last_error=bindparam("error"),
            **released(),
        )
        .returning(t.c.status, t.c.run_at)
    )


def heartbeat(model: Any) -> Update:
    """Extend the lease of jobs still owned. Fenced.

    Returns, per job extended, its id and whether a cancel of it was
    requested (``cancel_requested``). Parameters: ``ids``, ``tokens`` (lists),
    ``lease``.
    """
    t: Table = model.__table__
    return (
        update(t)
        .where(_owned_many(t))
        .values(lease_expires_at=func.now() + bindparam("lease", type_=Interval()))
        .returning(t.c.id, cancel_requested(t).label("cancel_requested"))
    )


def hand_back(model: Any) -> Update:
    """Give claimed jobs that never started back to pending. Fenced.

    The claim's attempt is taken back (``attempts - 1``); ``run_at`` and
    ``last_error`` are kept, so the job keeps its place in the queue. A job
    whose cancel was requested meanwhile is ``cancelled`` instead. Returns
    ``id``, ``queue`` and the new ``status`` of each job given back.
    Parameters: ``ids``, ``tokens`` (lists).
    """
    t: Table = model.__table__
    return (
        update(t)
        .where(_owned_many(t))
        .values(
            status=case((cancel_requested(t), CANCELLED), else_=PENDING),
            attempts=t.c.attempts - 1,
            finished_at=case((cancel_requested(t), func.now()), else_=None),
            **released(),
        )
        .returning(t.c.id, t.c.queue, t.c.status)
    )


def mark_cancelled(model: Any) -> Update:
    """End a claimed job as ``cancelled`` (parameters ``job_id``, ``token``,
    ``error``: its ``last_error``). Fenced; returns the id."""
    t: Table = model.__table__
    return (
        update(t)
        .where(_owned(t))
        .values(status=CANCELLED, finished_at=func.now(), last_error=bindparam("error"), **released())
        .returning(t.c.id)
    )


def bury(model: Any) -> Update:
    """Send claimed jobs to dead at once, each with a ``last_error`` of its own.

    A fenced ``fail(discard=True)`` of many jobs in one statement (the
    attempt counted by the claim stays counted). Parameters: ``ids``,
    ``tokens`` and ``errors``, lists of one length, matched by position.
    Returns the ids sent to dead.
    """
    t: Table = model.__table__
    given = (
        func.unnest(
            bindparam("ids", type_=ARRAY(t.c.id.type)),
            bindparam("tokens", type_=ARRAY(Uuid())),
            bindparam("errors", type_=ARRAY(Text())),
        )
        .table_valued(column("job_id", BigInteger()), column("token", Uuid()), column("error", Text()))
        .render_derived(name="given")
    )
    return (
        update(t)
        .where(t.c.id == given.c.job_id, t.c.lock_token == given.c.token, t.c.status == RUNNING_LITERAL)
        .values(status=DEAD, finished_at=func.now(), last_error=given.c.error, **released())
        .returning(t.c.id)
    )

def notify() -> TextClause:
    """``pg_notify`` once per queue (parameters ``channel``, ``queues``).

    NOTIFY is transactional: listeners hear it when the enqueueing
    transaction commits, never if it rolls back.
    """
    return text("SELECT pg_notify(:channel, q) FROM unnest(CAST(:queues AS text[])) AS q").bindparams(
        bindparam("queues", type_=ARRAY(String))
    )


def notify_column(model: Any) -> Any:
    """``pg_notify(:sajq_channel, queue)`` as a RETURNING column of a one-row INSERT.

    Folds the enqueue's NOTIFY into the INSERT's round trip; used for one row
    only, so it is one NOTIFY per statement, never one per row of a batch.
    """
    t: Table = model.__table__
    return func.pg_notify(bindparam("sajq_channel", type_=String()), t.c.queue).label("notified")


def complete_many(model: Any, *, keep_done: bool) -> Update | Delete:
    """Finish many claimed jobs in one statement; returns the ids it finished.

    Fenced like :func:`complete`: a job whose ``lock_token`` changed (lease
    expired, reaped, maybe claimed again) is left alone and missing from the
    result. Parameters: ``ids`` and ``tokens`` (lists).
    """
    t: Table = model.__table__
    owned = _owned_many(t)
    if not keep_done:
        return delete(t).where(owned).returning(t.c.id)
    return (
        update(t)
        .where(owned)
        .values(status=DONE, finished_at=func.now(), lease_expires_at=None, lock_token=None)
        .returning(t.c.id)
    )
