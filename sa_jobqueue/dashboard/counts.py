"""How the dashboard counts jobs on a big table: up to a limit, through an index, never the whole table.

A job table that keeps finished jobs holds millions of rows, and an exact
``count(*)`` of them reads every one: the overview's ``GROUP BY queue,
status`` took 145 ms at 1,000,000 jobs. So each count here stops at a
limit (:data:`COUNT_LIMIT`, 10,000), and a page shows a count that reached
it as ``10,000+``, as large dashboards do. Each reads one range of an
index, so its cost is bounded by the limit, not by the table (the
overview's throughput is not counted from the table at all: the workers
count what they finish, :mod:`sa_jobqueue.throughput`):

* :func:`queue_counts`: the ``(status, queue)`` pairs of the table (but the
  running jobs, which the lease index counts: as many as workers hold), found by
  skipping through ``ix_<t>_status_v1`` (one index descent per pair, a
  recursive CTE: PostgreSQL 15 has no skip scan), then the jobs of each
  pair counted up to the limit in that index; and each queue's oldest
  runnable job, by skipping through the claim index the same way, one
  descent per (queue, priority) of pending jobs;
* :func:`count_matching`: the jobs a filter of the jobs list matches, up to
  a limit (the confirmation page of an action).

Every function takes a :class:`~sqlalchemy.orm.Session` whose transaction
the caller owns and reads only (plain ``SELECT``s: ``ACCESS SHARE``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Table, and_, func, literal, literal_column, select, true, tuple_
from sqlalchemy.orm import Session

from ..repository import JobRepository
from ..states import PENDING, RUNNING, STATUS_INDEXED, STATUSES
from .filters import JobFilter
from .queries import check_path, conditions

COUNT_LIMIT = 10_000
"""A count stops past this many jobs; a page shows it as ``10,000+``."""


@dataclass(frozen=True)
class QueueCounts:
    """One queue of a table: jobs per status (every status, zero included), each counted up to
    ``limit`` and past it only by one, and the age of its oldest runnable job (None when none is)."""

    queue: str
    counts: dict[str, int]
    oldest_runnable_age: timedelta | None
    limit: int = COUNT_LIMIT

    def shown(self, status: str) -> str:
        """The count of ``status`` as a page shows it: ``1,234``, or ``10,000+`` past the limit."""
        return shown(self.counts[status], self.limit)


def shown(count: int, limit: int) -> str:
    """``count`` with thousands separators, or ``<limit>+`` when it is past ``limit``."""
    return f"{limit:,}+" if count > limit else f"{count:,}"


def _status(value: str) -> Any:
    # A literal, as in the partial indexes' predicates, so that they stay usable.
    return literal_column(f"'{value}'")


def _indexed(status: Any) -> Any:
    # ix_<t>_status_v1's predicate, spelled out: the planner uses a partial index only where it can prove it.
    return status.in_([_status(s) for s in STATUS_INDEXED])


def pair_counts(repository: JobRepository[Any], limit: int) -> Any:
    """The statement of :func:`queue_counts`'s counts: ``(status, queue, count)``, each count at most
    ``limit + 1``, one row per pair present in the table; the running jobs apart (:func:`running_counts`)."""
    t: Table = repository.table
    step = t.alias("step")
    first = select(t.c.status, t.c.queue).where(_indexed(t.c.status)).order_by(t.c.status, t.c.queue).limit(1)
    pairs = first.cte("pairs", recursive=True)
    following = (
        select(step.c.status, step.c.queue)
        .where(_indexed(step.c.status), tuple_(step.c.status, step.c.queue) > tuple_(pairs.c.status, pairs.c.queue))
        .order_by(step.c.status, step.c.queue)
        .limit(1)
        .lateral("following")
    )
    pairs = pairs.union_all(select(following.c.status, following.c.queue).select_from(
        pairs.join(following, true())))
    counted = t.alias("counted")
    # count(*) over a LIMIT in a scalar subquery: half the time of counting the rows of a LATERAL join.
    some = (
        select(literal(1).label("one"))
        .where(_indexed(counted.c.status), counted.c.status == pairs.c.status, counted.c.queue == pairs.c.queue)
        .limit(limit + 1)
        .correlate(pairs)
        .subquery("some")
    )
    count = select(func.count()).select_from(some).scalar_subquery()
    return select(pairs.c.status, pairs.c.queue, count.label("count"))


def running_counts(repository: JobRepository[Any]) -> Any:
    """The statement of the running jobs per queue, ``(status, queue, count)``, through the lease index
    (as many as the workers hold: they are not in ``ix_<t>_status_v1``)."""
    t: Table = repository.table
    return (select(t.c.status, t.c.queue, func.count()).where(t.c.status == _status(RUNNING))
            .group_by(t.c.status, t.c.queue))


def oldest_runnable(repository: JobRepository[Any]) -> Any:
    """The statement of :func:`queue_counts`'s ages: ``(queue, age)`` of each queue with pending jobs
    (age NULL when none of them is runnable yet), through the claim index."""
    t: Table = repository.table
    step = t.alias("step")
    pending = t.c.status == _status(PENDING)
    first = (select(t.c.queue, t.c.priority, t.c.run_at).where(pending)
             .order_by(t.c.queue, t.c.priority, t.c.run_at).limit(1))
    heads = first.cte("heads", recursive=True)
    following = (
        select(step.c.queue, step.c.priority, step.c.run_at)
        .where(step.c.status == _status(PENDING),
               tuple_(step.c.queue, step.c.priority) > tuple_(heads.c.queue, heads.c.priority))
        .order_by(step.c.queue, step.c.priority, step.c.run_at)
        .limit(1)
        .lateral("following")
    )
    heads = heads.union_all(select(following.c.queue, following.c.priority, following.c.run_at).select_from(
        heads.join(following, true())))
    # The first run_at of each priority is its oldest: runnable when it is not in the future.
    age = func.max(func.now() - heads.c.run_at).filter(heads.c.run_at <= func.now())
    return select(heads.c.queue, age.label("age")).group_by(heads.c.queue)


def queue_counts(session: Session, repository: JobRepository[Any], limit: int = COUNT_LIMIT) -> list[QueueCounts]:
    """Per queue, in name order: jobs per status counted up to ``limit``, and the oldest runnable job's age."""
    by_queue: dict[str, dict[str, int]] = {}
    for statement in (pair_counts(repository, limit), running_counts(repository)):
        for status, queue, count in session.execute(statement):
            by_queue.setdefault(queue, dict.fromkeys(STATUSES, 0))[status] = int(count)
    ages: dict[str, timedelta | None] = {q: age for q, age in session.execute(oldest_runnable(repository))}
    return [QueueCounts(q, by_queue[q], ages.get(q), limit) for q in sorted(by_queue)]


def count_matching(session: Session, repository: JobRepository[Any], wanted: JobFilter, limit: int) -> int:
    """How many jobs match ``wanted`` (its keyset included), counted up to ``limit + 1``: a result over
    ``limit`` means "more". A ``payload_path`` PostgreSQL cannot parse raises
    :class:`~sa_jobqueue.dashboard.filters.FilterError`."""
    t: Table = repository.table
    if wanted.payload_path is not None:
        check_path(session, wanted.payload_path)
    some = select(literal(1).label("one")).where(and_(true(), *conditions(t, wanted))).limit(limit + 1)
    return int(session.execute(select(func.count()).select_from(some.subquery("some"))).scalar_one())


__all__ = [
    "COUNT_LIMIT", "QueueCounts", "count_matching", "oldest_runnable",
    "pair_counts", "running_counts", "queue_counts", "shown",
]
