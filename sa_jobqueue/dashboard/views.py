"""The dashboard's pages, independent of the web framework that serves them.

:class:`Views` answers each page with a :class:`Rendered` (a template, its
context and the HTTP status); the ASGI app (:mod:`sa_jobqueue.dashboard.asgi`)
turns that into a response. Every page runs in a transaction of its own that
is READ ONLY, with a ``statement_timeout``, so a page can neither write nor
run long; a bad filter is a 400 with its message, an unknown table or job a
404, and no page shows a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ..checks import INT64_MAX
from ..repository import JobRepository
from ..states import STATUSES
from . import queries
from .filters import FILTER_STATUSES, SCHEDULED, FilterError, JobFilter, parse_filter
from .health import DEAD_TUPLES_RATIO, OLDEST_RUNNABLE_LIMIT, OLDEST_TRANSACTION_LIMIT, table_health

# A page's statements give up after this: a dashboard must not load the queue's database.
STATEMENT_TIMEOUT = timedelta(seconds=5)


@dataclass(frozen=True)
class Rendered:
    """A page to render: ``template`` with ``context``, answered with ``status``."""

    template: str
    context: dict[str, Any]
    status: int = 200


@dataclass(frozen=True)
class TableOverview:
    """One table on the overview."""

    name: str
    queues: list[queries.QueueCounts]
    throughput: list[queries.Minute] | None
    health: Any


@dataclass
class Views:
    """The pages over ``repositories`` (one per job table, by table name), read through ``engine``."""

    engine: Engine
    repositories: Sequence[JobRepository[Any]]
    title: str = "sa_jobqueue"
    tables: dict[str, JobRepository[Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.tables = {repo.table.name: repo for repo in self.repositories}
        if not self.tables:
            raise ValueError("repositories: give at least one JobRepository")

    @contextmanager
    def _reading(self) -> Iterator[Session]:
        with Session(self.engine) as session, session.begin():
            session.execute(text("SET TRANSACTION READ ONLY"))
            session.execute(text(f"SET LOCAL statement_timeout = {int(STATEMENT_TIMEOUT.total_seconds() * 1000)}"))
            yield session
            session.rollback()  # it wrote nothing; ending it so is the cheapest

    def _page(self, template: str, page: str, status: int = 200, **context: Any) -> Rendered:
        limits = {"runnable": OLDEST_RUNNABLE_LIMIT, "transaction": OLDEST_TRANSACTION_LIMIT,
                  "dead_ratio": DEAD_TUPLES_RATIO}
        return Rendered(template, {"title": self.title, "page": page, "limits": limits, **context}, status)

    def error(self, status: int, heading: str, message: str) -> Rendered:
        """An error page: ``heading`` and ``message`` shown, answered with ``status``."""
        return self._page("error.html", "error", status, heading=heading, message=message)

    def overview(self) -> Rendered:
        """Per table and queue: counts by status, throughput over the last hour, and the table's health."""
        with self._reading() as session:
            tables = [
                TableOverview(name, queries.queue_counts(session, repo), queries.throughput(session, repo),
                              table_health(session, repo.table))
                for name, repo in self.tables.items()
            ]
        return self._page("overview.html", "overview", tables=tables, statuses=STATUSES, live_url="/events")

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
        context.update(jobs=found.jobs, next_query=next_query)
        return self._page("jobs.html", page, heading=heading, **context)

    def job(self, table: str, job_id: str) -> Rendered:
        """One job of ``table``: everything the row holds."""
        repo = self.tables.get(table)
        if repo is None or not job_id.isdigit() or len(job_id) > 19 or int(job_id) > INT64_MAX:
            return self.error(404, "No such job", f"no job {job_id[:40]!r} in {table[:80]!r}")
        with self._reading() as session:
            job = queries.job_detail(session, repo, int(job_id))
        if job is None:
            return self.error(404, "No such job", f"no job {job_id} in {table} (finished and deleted, or purged)")
        return self._page("job.html", "jobs", job=job, table=table, own_columns=sorted(queries.user_columns(repo)))


__all__ = ["STATEMENT_TIMEOUT", "Rendered", "TableOverview", "Views"]
