"""The dashboard's pages, independent of the web framework that serves them.

:class:`Views` answers each page with a :class:`Rendered` (a template, its
context and the HTTP status); the ASGI app (:mod:`sa_jobqueue.dashboard.asgi`)
turns that into a response. Every page runs in a transaction of its own that
is READ ONLY, with a ``statement_timeout``, so a page can neither write nor
run long; a bad filter is a 400 with its message, an unknown table or job a
404, and no page shows a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ..checks import INT64_MAX, check_name
from ..errors import InvalidArgumentError
from ..repository import JobRepository
from ..states import PRIORITY_MAX, PRIORITY_MIN, STATUSES
from ..throughput import Minute
from . import counts, operations, queries
from .actions import ACTIONS, apply
from .filters import FILTER_STATUSES, SCHEDULED, FilterError, JobFilter, parse_filter
from .health import DEAD_TUPLES_RATIO, OLDEST_RUNNABLE_LIMIT, OLDEST_TRANSACTION_LIMIT, table_health
from .page import Rendered
from .schedules import schedules

# The confirmation page counts matching jobs up to this many (counting a million rows is a scan).
CONFIRM_COUNT_LIMIT = counts.COUNT_LIMIT
# A page's statements give up after this: a dashboard must not load the queue's database.
STATEMENT_TIMEOUT = timedelta(seconds=5)


@dataclass(frozen=True)
class TableOverview:
    """One table on the overview."""

    name: str
    queues: list[counts.QueueCounts]
    throughput: list[Minute] | None
    health: Any


@dataclass
class Views:
    """The pages over ``repositories`` (one per job table, by table name), read through ``engine``."""

    engine: Engine
    repositories: Sequence[JobRepository[Any]]
    title: str = "sa_jobqueue"
    read_only: bool = False
    tables: dict[str, JobRepository[Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.tables = {repo.table.name: repo for repo in self.repositories}
        if not self.tables:
            raise ValueError("repositories: give at least one JobRepository")

    def answer(self, make: Callable[[], Rendered]) -> Rendered:
        """``make()``'s page, or, when the database fails it (down, a table missing), a 503 page that says
        what the database answered: a page never fails with a traceback."""
        try:
            return make()
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            message = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
            return self.error(503, "The database failed this page", message[:300])

    @contextmanager
    def _reading(self) -> Iterator[Session]:
        with Session(self.engine) as session, session.begin():
            session.execute(text("SET TRANSACTION READ ONLY"))
            session.execute(text(f"SET LOCAL statement_timeout = {int(STATEMENT_TIMEOUT.total_seconds() * 1000)}"))
            # A page's statements are short; compiling one whose plan's cost passes jit_above_cost on a big
            # table costs more than it saves.
            session.execute(text("SET LOCAL jit = off"))
            yield session
            session.rollback()  # it wrote nothing; ending it so is the cheapest

    def _page(self, template: str, page: str, status: int = 200, **context: Any) -> Rendered:
        limits = {"runnable": OLDEST_RUNNABLE_LIMIT, "transaction": OLDEST_TRANSACTION_LIMIT,
                  "dead_ratio": DEAD_TUPLES_RATIO}
        return Rendered(template, {"title": self.title, "page": page, "limits": limits, "read_only": self.read_only,
                                   "actions": ACTIONS, **context}, status)

    def error(self, status: int, heading: str, message: str) -> Rendered:
        """An error page: ``heading`` and ``message`` shown, answered with ``status``."""
        return self._page("error.html", "error", status, heading=heading, message=message)

    def overview(self) -> Rendered:
        """Per table and queue: counts by status, throughput over the last hour, and the table's health."""
        with self._reading() as session:
            tables = [
                TableOverview(name, counts.queue_counts(session, repo), operations.throughput_of(session, name),
                              table_health(session, repo.table))
                for name, repo in self.tables.items()
            ]
            paused = operations.paused_of(session, list(self.tables))
        return self._page("overview.html", "overview", tables=tables, statuses=STATUSES, live_url="/events",
                          paused=paused or {}, pausing=paused is not None, queue_operations=operations.QUEUE_OPERATIONS)

    def jobs(self, params: Mapping[str, str]) -> Rendered:
        """The jobs of one table matching the filter in ``params``, a page of them, newest first."""
        name = params.get("table") or next(iter(self.tables))
        repo = self.tables.get(name)
        if repo is None:
            return self.error(404, "No such table", f"table: {name[:80]!r} is not a job table of this dashboard "
                                                   f"({', '.join(self.tables)})")
        own = sorted(queries.user_columns(repo))
        context: dict[str, Any] = {
            "table": name, "table_names": list(self.tables), "filter_statuses": FILTER_STATUSES,
            "own_columns": own, "jobs": [], "next_query": None, "wanted": JobFilter(), "live_url": "/events",
        }
        try:
            wanted = parse_filter(params, frozenset(own))
            context["wanted"] = wanted
            with self._reading() as session:
                found = queries.jobs_page(session, repo, wanted)
        except FilterError as exc:
            return self._page("jobs.html", "jobs", 400, heading="Jobs", error=str(exc), **context)
        page = {"dead": "dead", SCHEDULED: "scheduled"}.get(wanted.status or "", "jobs")
        heading = {"dead": "Dead jobs", "scheduled": "Scheduled jobs"}.get(page, "Jobs")
        next_query = None if found.next_before is None else {"table": name, **wanted.query(before=found.next_before)}
        context.update(jobs=found.jobs, next_query=next_query, action_query={"table": name, **wanted.query()})
        return self._page("jobs.html", page, heading=heading, **context)

    def periodic(self) -> Rendered:
        """The periodic schedules of the tables: last tick enqueued, next tick due."""
        with self._reading() as session:
            found = schedules(session, list(self.tables))
            now = session.execute(text("SELECT now()")).scalar_one()
        return self._page("periodic.html", "periodic", schedules=found, now=now)

    def job(self, table: str, job_id: str) -> Rendered:
        """One job of ``table``: everything the row holds."""
        repo = self.tables.get(table)
        if repo is None or not job_id.isdigit() or len(job_id) > 19 or int(job_id) > INT64_MAX:
            return self.error(404, "No such job", f"no job {job_id[:40]!r} in {table[:80]!r}")
        with self._reading() as session:
            job = queries.job_detail(session, repo, int(job_id))
        if job is None:
            return self.error(404, "No such job", f"no job {job_id} in {table} (finished and deleted, or purged)")
        return self._page("job.html", "jobs", job=job, table=table, own_columns=sorted(queries.user_columns(repo)),
                          action_query={"table": table, "id": str(job.id)})


    def _target(self, params: Mapping[str, str]) -> tuple[str, JobRepository[Any], str, JobFilter] | Rendered:
        """An action's table, repository, name and filter (without its keyset: every match), or an error page."""
        name, action = params.get("table", ""), params.get("action", "")
        repo = self.tables.get(name)
        if repo is None:
            return self.error(404, "No such table", f"table: {name[:80]!r} is not a job table of this dashboard")
        if action not in ACTIONS:
            return self.error(400, "No such action", f"action: must be one of {', '.join(ACTIONS)}, "
                                                     f"got {action[:40]!r}")
        filter_params = {k: v for k, v in params.items() if k not in ("action", "csrf", "priority", "confirm")}
        try:
            wanted = replace(parse_filter(filter_params, queries.user_columns(repo)), before=None)
        except FilterError as exc:
            return self.error(400, "Bad filter", str(exc))
        return name, repo, action, wanted

    def confirm(self, params: Mapping[str, str], token: str) -> Rendered:
        """The page that asks before an action: what it does, to how many jobs; its form carries ``token``."""
        target = self._target(params)
        if isinstance(target, Rendered):
            return target
        name, repo, action, wanted = target
        try:
            with self._reading() as session:
                count = counts.count_matching(session, repo, wanted, CONFIRM_COUNT_LIMIT)
        except FilterError as exc:
            return self.error(400, "Bad filter", str(exc))
        shown = counts.shown(count, CONFIRM_COUNT_LIMIT)
        fields = {"table": name, "action": action, **wanted.query()}
        return self._page("confirm.html", "jobs", action=ACTIONS[action], action_name=action, count=shown,
                          fields=fields, token=token, back={"table": name, **wanted.query()})

    def act(self, params: Mapping[str, str]) -> Rendered:
        """Apply the action the confirmation page posted; the page says what changed."""
        target = self._target(params)
        if isinstance(target, Rendered):
            return target
        name, repo, action, wanted = target
        priority = 0
        if action == "priority":
            raw = params.get("priority", "").strip()
            if not raw.lstrip("-").isdigit() or len(raw) > 6 or not PRIORITY_MIN <= int(raw) <= PRIORITY_MAX:
                return self.error(400, "Bad priority", f"priority: must be a whole number from {PRIORITY_MIN} "
                                                       f"to {PRIORITY_MAX}, got {raw[:40]!r}")
            priority = int(raw)
        try:
            outcome = apply(self.engine, repo, action, wanted, priority)
        except FilterError as exc:
            return self.error(400, "Bad filter", str(exc))
        return self._page("done.html", "jobs", action=ACTIONS[action], outcome=outcome,
                          back={"table": name, **wanted.query()})

    def workers(self) -> Rendered:
        """The worker processes serving the tables: alive first, what each runs and since when."""
        with self._reading() as session:
            found = operations.workers_of(session, list(self.tables))
            now = session.execute(text("SELECT now()")).scalar_one()
        rows = None if found is None else [(w, operations.running_of(w)) for w in found]
        return self._page("workers.html", "workers", workers=rows, now=now, live_url="/events")

    def _queue_target(self, params: Mapping[str, str]) -> tuple[str, JobRepository[Any], str, str] | Rendered:
        """A queue operation's table, repository, operation and queue, or an error page."""
        name, operation = params.get("table", ""), params.get("operation", "")
        repo = self.tables.get(name)
        if repo is None:
            return self.error(404, "No such table", f"table: {name[:80]!r} is not a job table of this dashboard")
        if operation not in operations.QUEUE_OPERATIONS:
            return self.error(400, "No such operation", f"operation: must be pause or resume, got {operation[:40]!r}")
        try:
            queue = check_name("queue", params.get("queue", ""))
        except InvalidArgumentError as exc:
            return self.error(400, "Bad queue", str(exc)[:300])
        return name, repo, operation, queue

    def confirm_queue(self, params: Mapping[str, str], token: str) -> Rendered:
        """The page that asks before pausing or resuming a queue; its form carries ``token``."""
        target = self._queue_target(params)
        if isinstance(target, Rendered):
            return target
        name, _, operation, queue = target
        return self._page("confirm_queue.html", "overview", operation=operation,
                          label=operations.QUEUE_OPERATIONS[operation], table=name, queue=queue, token=token)

    def queue_act(self, params: Mapping[str, str]) -> Rendered:
        """Pause or resume the queue the confirmation page posted."""
        target = self._queue_target(params)
        if isinstance(target, Rendered):
            return target
        name, repo, operation, queue = target
        changed = operations.change_queue(self.engine, repo, operation, queue)
        return self._page("queue_done.html", "overview", operation=operation, table=name, queue=queue,
                          changed=changed)


__all__ = ["CONFIRM_COUNT_LIMIT", "STATEMENT_TIMEOUT", "Rendered", "TableOverview", "Views"]
