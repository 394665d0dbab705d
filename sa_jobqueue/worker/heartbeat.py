"""The heartbeat of held jobs, and cancel requests: shared by both drivers.

:func:`heartbeat` extends the leases of the jobs a worker holds, one
statement per table in a transaction of its own, and reports what it
learned: a job whose lease was lost (its completion will be refused by the
fence) is logged, and a job whose cancel was asked for from another process
goes to ``cancel``. The same transaction writes the progress the held jobs'
handlers reported since the last beat (:mod:`sa_jobqueue.progress`).
:func:`request_cancel` is what both drivers do first
with such a job: mark it and tell it (``job.cancel_requested_at``); the
thread worker then lets the handler return, the asyncio worker also
cancels the handler's coroutine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone

from ..progress import record_progress
from .books import Held
from .context import WorkerContext

log = logging.getLogger("sa_jobqueue.worker")


def heartbeat(ctx: WorkerContext, cancel: Callable[[Held], None]) -> None:
    """Extend the leases of the held jobs; call ``cancel`` for each whose cancel was asked for."""
    held = ctx.books.held()
    for repo in ctx.repositories:
        mine = [h for h in held if h.repo is repo]
        if not mine:
            continue
        try:
            with ctx.control() as session:
                report = repo.extend_leases(session, [h.job for h in mine], lease=ctx.options.lease)
                # Progress rides on the beat: the reports since the last one, in one statement.
                moved = [h for h in mine if h.job.id in report.owned and h.job.progress is not h.progress_sent]
                if moved:
                    record_progress(session, repo.table, [h.job for h in moved])
        except Exception:
            log.exception("worker %s: heartbeat failed", ctx.name)
            continue
        for h in moved:
            h.progress_sent = h.job.progress
        for h in mine:
            if h.job.id not in report.owned and ctx.books.holds(h.job):
                log.warning("worker %s: lost the lease of job %s (%s); its completion will be refused",
                            ctx.name, h.job.id, h.job.task)
            elif h.job.id in report.cancel_requested:
                cancel(h)


def request_cancel(ctx: WorkerContext, held: Held) -> bool:
    """Mark ``held`` as asked to cancel and tell its job; False when it already was."""
    if held.cancel_requested:
        return False
    held.cancel_requested = True
    try:
        held.job.cancel_requested_at = datetime.now(timezone.utc)
    except AttributeError:  # pragma: no cover - a snapshot without the column
        pass
    log.info("worker %s: job %s (%s): cancel requested", ctx.name, held.job.id, held.job.task)
    return True
