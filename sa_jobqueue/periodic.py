"""Periodic jobs: cron schedules whose ticks are enqueued exactly once.

::

    @tasks.periodic("*/5 * * * *", payload={"kind": "digest"})
    @tasks.task
    def send_digest(job: EmailJob, session: Session) -> None: ...

    tasks.schedule("0 3 * * *", "cleanup", name="nightly-cleanup")  # no decorator

Every worker whose registry has schedules runs a due-pass every
``periodic_interval`` seconds (:meth:`PeriodicScheduler.run_due`). The table
``sa_jobqueue_periodic`` keeps, per schedule (job table, queue, name), the
last tick enqueued. A pass moves that tick forward with a compare-and-set
upsert in the same transaction as the enqueue; of several workers that see
the same tick, only the one whose upsert matched enqueues it, and the row is
kept after the tick's job is done and deleted. See docs/periodic.md.

A schedule itself (:class:`Periodic`, :func:`check_cron`) is defined in
:mod:`sa_jobqueue.schedule`, which the registry uses; both names are
importable from here too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, Protocol, cast, runtime_checkable

from sqlalchemy import DateTime, Engine, String, Table, Text, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from .checks import check_aware, check_interval, check_session
from .errors import InvalidArgumentError
from .repository import JobRepository
from .schedule import Periodic, check_cron
from .spec import JobSpec


@runtime_checkable
class HasSchedules(Protocol):
    """What the scheduler takes of a :class:`~sa_jobqueue.TaskRegistry`: its schedules."""

    @property
    def periodic_tasks(self) -> list[Periodic]: ...

log = logging.getLogger("sa_jobqueue.periodic")

PERIODIC_TABLE = "sa_jobqueue_periodic"
# catch_up=True enqueues at most this many missed ticks of one schedule per
# pass; the next pass goes on from the last one enqueued.
MAX_CATCH_UP = 100


class PeriodicBase(DeclarativeBase):
    """The declarative base of :class:`PeriodicState` (a target of the
    project's Alembic environment next to ``sa_jobqueue.default.Base``)."""


class PeriodicState(PeriodicBase):
    """The last tick enqueued per schedule; ``name`` is ``<job table>/<queue>/<schedule name>``."""

    __tablename__ = PERIODIC_TABLE

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    last_tick: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    cron: Mapped[str] = mapped_column(String(255))


PERIODIC = cast(Table, PeriodicState.__table__)


def create_periodic_table(bind: Engine | Connection) -> None:
    """Create ``sa_jobqueue_periodic`` unless it exists (the Alembic revision 0002 does the same)."""
    if not isinstance(bind, (Engine, Connection)):
        raise InvalidArgumentError("bind", "must be an Engine or a Connection")
    PeriodicBase.metadata.create_all(bind, checkfirst=True)


def _utc(now: object) -> datetime:
    checked = check_aware("now", now)  # type: ignore[arg-type]
    if checked is None:
        raise InvalidArgumentError("now", "must be an aware datetime")
    return checked.astimezone(timezone.utc)


class PeriodicScheduler:
    """Enqueues the due ticks of a set of schedules into one job table.

    The worker builds one from its registry and its first repository, with
    the schedules of the queues it serves; tests and apps can call
    :meth:`run_due` themselves with an explicit ``now``.
    """

    def __init__(
        self,
        repository: JobRepository[Any],
        schedules: HasSchedules | Iterable[Periodic],
        *,
        queues: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(repository, JobRepository):
            raise InvalidArgumentError("repository", "must be a JobRepository")
        # A TaskRegistry, by what it has: the registry's module sits above this one.
        entries = schedules.periodic_tasks if isinstance(schedules, HasSchedules) else list(schedules)
        for entry in entries:
            if not isinstance(entry, Periodic):
                raise InvalidArgumentError("schedules", f"must hold Periodic entries, got {type(entry).__name__}")
        self.repository = repository
        self.schedules = [e for e in entries if queues is None or e.queue in queues]
        self._keys = {e: f"{repository.table.name}/{e.queue}/{e.name}" for e in self.schedules}
        # Per schedule, the latest tick this process knows is taken: a pass
        # whose due tick is not newer sends nothing but SELECT now().
        self._known: dict[Periodic, datetime] = {}

    def __bool__(self) -> bool:
        return bool(self.schedules)

    def key(self, entry: Periodic) -> str:
        """The row name of ``entry`` in ``sa_jobqueue_periodic``."""
        return self._keys[entry]

    def due(self, now: datetime) -> list[Periodic]:
        """The schedules that may have a tick to enqueue at ``now``: all but those
        whose latest tick this process already saw taken (no statement is sent)."""
        now = _utc(now)
        return [e for e in self.schedules if e not in self._known or self._known[e] < e.latest_tick(now)]

    def run_due(self, session: Session, *, now: datetime | None = None) -> list[Any]:
        """Enqueue the ticks due at ``now`` (default: the database's ``now()``)
        in the caller's transaction and return the jobs enqueued.

        Commit the session's transaction to publish both the jobs and the
        ticks taken; a rollback undoes both. A schedule seen for the first
        time records its latest tick and enqueues nothing: ticks before a
        schedule existed are not owed.
        """
        session = check_session(session)
        if now is None:
            now = session.execute(select(func.now())).scalar_one()
        now = _utc(now)
        due = self.due(now)
        if not due:
            return []
        table = PERIODIC
        rows = session.execute(
            select(table.c.name, table.c.last_tick).where(table.c.name.in_([self._keys[e] for e in due]))
        ).all()
        seen: dict[str, datetime] = {name: tick for name, tick in rows}
        jobs: list[Any] = []
        for entry in due:
            key = self._keys[entry]
            last = seen.get(key)
            if last is None:
                ticks: list[datetime] = []
                target = entry.latest_tick(now)
            elif entry.catch_up:
                ticks = entry.ticks_after(last, now, MAX_CATCH_UP)
                target = ticks[-1] if ticks else last
            else:
                latest = entry.latest_tick(now)
                ticks = [latest] if latest > last else []
                target = latest
            if last is not None and not ticks:
                self._known[entry] = last
                continue
            if not self._advance(session, entry, key, last, target):
                log.debug("periodic %s: another worker took the ticks up to %s first", key, target)
                continue
            self._known[entry] = target
            if ticks:
                jobs.extend(self.repository.enqueue_many(session, [
                    JobSpec(
                        task=entry.task, payload=entry.payload, queue=entry.queue, priority=entry.priority,
                        run_at=tick, dedupe_key=entry.dedupe_key(tick),
                    )
                    for tick in ticks
                ]))
        return jobs

    def _advance(self, session: Session, entry: Periodic, key: str, last: datetime | None, target: datetime) -> bool:
        """Compare-and-set the schedule's last tick from ``last`` to ``target``.

        The row lock of the upsert serialises workers; after waiting for
        another's commit, the WHERE is evaluated on the row that committed,
        so only one of them sees its upsert return a row.
        """
        table = PERIODIC
        insert = pg_insert(table).values(name=key, last_tick=target, cron=entry.cron)
        if last is None:
            # A first sighting: a concurrent first insert wins, this one returns nothing.
            statement = insert.on_conflict_do_nothing(index_elements=[table.c.name])
        else:
            statement = insert.on_conflict_do_update(
                index_elements=[table.c.name],
                set_={"last_tick": insert.excluded.last_tick, "cron": insert.excluded.cron},
                where=(table.c.last_tick == last) & (table.c.last_tick < insert.excluded.last_tick),
            )
        return session.execute(statement.returning(table.c.name)).first() is not None


__all__ = [
    "MAX_CATCH_UP", "PERIODIC", "PERIODIC_TABLE", "Periodic", "PeriodicBase", "PeriodicScheduler", "PeriodicState",
    "check_cron", "check_interval", "create_periodic_table",
]
