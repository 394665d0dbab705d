"""Prometheus metrics (the ``prometheus`` extra: ``pip install 'sa_jobqueue[prometheus]'``).

Two parts, both optional:

* :class:`JobMetrics` counts what the workers of this process do, from
  :mod:`sa_jobqueue.signals`: jobs started, succeeded, failed (by new
  status) and reaped, and a histogram of handler durations, labelled by task
  and queue (and table for reaps).
* :class:`QueueCollector` reads the queue tables at scrape time through
  :meth:`JobRepository.stats`: jobs per queue and status, and the age of the
  oldest runnable job per queue (the queue's latency); from the operations
  tables (revision 0007), the live worker processes per table and the
  paused queues. Run it in one process
  (a web app or a sidecar), not in every worker: each scrape is a query.

::

    from prometheus_client import start_http_server
    from sa_jobqueue.prometheus import JobMetrics, QueueCollector

    JobMetrics().connect()                       # in each worker process
    QueueCollector(engine, [emails, reports]).register()
    start_http_server(9100)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from . import signals
from .control_tables import WORKERS_TABLE
from .pausing import paused_queues
from .presence import list_workers
from .repository import JobRepository

# Handler run times: 1 ms to 10 min.
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)


class JobMetrics:
    """Counters and a duration histogram fed by the worker signals of this process."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, *, namespace: str = "sa_jobqueue") -> None:
        labels = ["task", "queue"]
        self.started = Counter("jobs_started", "Handlers started.", labels, namespace=namespace, registry=registry)
        self.succeeded = Counter(
            "jobs_succeeded", "Jobs whose completion committed.", labels, namespace=namespace, registry=registry
        )
        self.failed = Counter(
            "jobs_failed", "Failed attempts recorded, by the job's new status (pending: retried; dead).",
            [*labels, "status"], namespace=namespace, registry=registry,
        )
        self.reaped = Counter(
            "jobs_reaped", "Jobs whose lease expired, by the status the reaper gave them.",
            ["table", "status"], namespace=namespace, registry=registry,
        )
        self.duration = Histogram(
            "job_duration_seconds", "Handler run time of finished attempts.", [*labels, "outcome"],
            namespace=namespace, registry=registry, buckets=BUCKETS,
        )

    def connect(self) -> JobMetrics:
        """Start counting (receivers are held strongly until :meth:`disconnect`)."""
        signals.job_started.connect(self._started, weak=False)
        signals.job_succeeded.connect(self._succeeded, weak=False)
        signals.job_failed.connect(self._failed, weak=False)
        signals.jobs_reaped.connect(self._reaped, weak=False)
        return self

    def disconnect(self) -> None:
        signals.job_started.disconnect(self._started)
        signals.job_succeeded.disconnect(self._succeeded)
        signals.job_failed.disconnect(self._failed)
        signals.jobs_reaped.disconnect(self._reaped)

    def _started(self, sender: Any, *, job: Any, **extra: Any) -> None:
        self.started.labels(job.task, job.queue).inc()

    def _succeeded(self, sender: Any, *, job: Any, duration: float, **extra: Any) -> None:
        self.succeeded.labels(job.task, job.queue).inc()
        self.duration.labels(job.task, job.queue, "succeeded").observe(duration)

    def _failed(self, sender: Any, *, job: Any, status: str, duration: float, **extra: Any) -> None:
        self.failed.labels(job.task, job.queue, status).inc()
        self.duration.labels(job.task, job.queue, "failed").observe(duration)

    def _reaped(self, sender: Any, *, table: str, requeued: int, dead: int, **extra: Any) -> None:
        if requeued:
            self.reaped.labels(table, "pending").inc(requeued)
        if dead:
            self.reaped.labels(table, "dead").inc(dead)


class QueueCollector(Collector):
    """Queue depth and latency, read from the job tables at each scrape."""

    def __init__(
        self, engine: Engine, repositories: Sequence[JobRepository[Any]], *, namespace: str = "sa_jobqueue",
        statement_timeout_ms: int = 5000,
    ) -> None:
        self._engine = engine
        self._repositories = list(repositories)
        self._namespace = namespace
        self._timeout = int(statement_timeout_ms)

    def register(self, registry: CollectorRegistry = REGISTRY) -> QueueCollector:
        registry.register(self)
        return self

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            f"{self._namespace}_jobs", "Jobs in the table, by queue and status.", labels=["table", "queue", "status"]
        )
        oldest = GaugeMetricFamily(
            f"{self._namespace}_oldest_runnable_age_seconds",
            "How long the oldest runnable pending job of the queue has waited.", labels=["table", "queue"],
        )
        with Session(self._engine) as session, session.begin():
            # A scrape must never hang on a busy database.
            session.execute(text(f"SET LOCAL statement_timeout = {self._timeout}"))
            for repo in self._repositories:
                for row in repo.stats(session):
                    jobs.add_metric([repo.table.name, row.queue, row.status], row.count)
                    if row.oldest_runnable_age is not None:
                        oldest.add_metric([repo.table.name, row.queue], row.oldest_runnable_age.total_seconds())
        yield jobs
        yield oldest
        yield from self._operations()

    def _operations(self) -> Iterator[Metric]:
        """Live workers per table and paused queues, from the operations tables
        (none of either when revision 0007 was not run)."""
        alive = GaugeMetricFamily(f"{self._namespace}_workers_alive",
                                  "Worker processes whose presence beat is current, by job table served.",
                                  labels=["table"])
        paused = GaugeMetricFamily(f"{self._namespace}_queue_paused", "1 for each paused queue.",
                                   labels=["table", "queue"])
        tables = [repo.table.name for repo in self._repositories]
        with Session(self._engine) as session, session.begin():
            session.execute(text(f"SET LOCAL statement_timeout = {self._timeout}"))
            if session.execute(text("SELECT to_regclass(:name)"), {"name": WORKERS_TABLE}).scalar_one() is not None:
                workers = [w for w in list_workers(session, tables=tables) if w.alive]
                for table in tables:
                    alive.add_metric([table], sum(1 for w in workers if table in w.tables))
                for table, queues in sorted(paused_queues(session, tables).items()):
                    for queue in sorted(queues):
                        paused.add_metric([table, queue], 1)
        yield alive
        yield paused


__all__ = ["BUCKETS", "JobMetrics", "QueueCollector"]
