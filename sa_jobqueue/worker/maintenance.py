"""Maintenance duties of a worker: the reaper and the periodic pass.

Each duty is one small object with ``run()``, called by the worker's loop
every ``interval`` seconds. Each runs its statements in transactions of
its own and logs its failures instead of raising, so one failing duty
never stops the worker or the others.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from .. import signals
from ..periodic import PERIODIC
from .job_sessions import read_committed_connection

if TYPE_CHECKING:
    from ..periodic import PeriodicScheduler
    from .context import WorkerContext

log = logging.getLogger("sa_jobqueue.worker")


class Reaper:
    """Sends the expired leases of crashed workers back to pending (or dead)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.interval = ctx.options.reap_interval
        self._limits = {t.name: t.max_attempts for t in ctx.tasks if t.max_attempts is not None}

    def run(self) -> bool:
        ctx = self.ctx
        for repo in ctx.repositories:
            try:
                with ctx.control() as session:
                    reaped = repo.reap(session, task_max_attempts=self._limits)
            except Exception:
                log.exception("worker %s: reap failed", ctx.name)
                continue
            cancelled = getattr(reaped, "cancelled", 0)
            if reaped.requeued or reaped.dead or cancelled:
                log.warning(
                    "worker %s: reaped %s expired job(s) of %s: %s back to pending, %s dead, %s cancelled",
                    ctx.name, reaped.requeued + reaped.dead + cancelled, repo.table.name, reaped.requeued,
                    reaped.dead, cancelled,
                )
                signals.send(signals.jobs_reaped, ctx.sender, repository=repo, table=repo.table.name,
                             requeued=reaped.requeued, dead=reaped.dead)
        return False


class PeriodicPass:
    """Enqueues the due ticks of the periodic schedules of the worker's queues."""

    def __init__(self, ctx: WorkerContext, scheduler: PeriodicScheduler) -> None:
        self.ctx = ctx
        self.scheduler = scheduler
        self.interval = ctx.options.periodic_interval
        self._failing = False

    def run(self) -> bool:
        """True when a job was enqueued (the worker claims it without waiting for a NOTIFY)."""
        ctx = self.ctx
        try:
            if ctx.autocommit_control:
                # Nothing new due (the usual case): one autocommit SELECT now(), no transaction.
                with ctx.control() as session:
                    now = session.execute(select(func.now())).scalar_one()
                if not self.scheduler.due(now):
                    self._failing = False
                    return False
            with ctx.sessions() as session, session.begin():
                read_committed_connection(session, [PERIODIC, *ctx.control.tables])
                jobs: Any = self.scheduler.run_due(session)
        except Exception:
            # Logged once per run of failures (a missing sa_jobqueue_periodic
            # table would otherwise log every periodic_interval).
            if not self._failing:
                log.exception("worker %s: the periodic pass failed (is the table sa_jobqueue_periodic "
                              "created? see docs/periodic.md)", ctx.name)
            self._failing = True
            return False
        self._failing = False
        return bool(jobs)
