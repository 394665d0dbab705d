"""Signals a worker sends about its jobs, for metrics, tracing and alerts.

Built on blinker, the signal library Flask uses. Connect a receiver, which
gets the sending :class:`~sa_jobqueue.Worker` and keyword arguments::

    from sa_jobqueue import signals

    @signals.job_failed.connect
    def count_failure(worker, job, error, status, **extra):
        FAILURES.labels(job.task, status).inc()

=================  ====================================================  =========================
signal             sent                                                  keyword arguments
=================  ====================================================  =========================
``job_started``    before the handler runs                               ``job``
``job_succeeded``  after the job's completion committed                  ``job``, ``duration``
``job_failed``     after a failed attempt was recorded (committed)       ``job``, ``error``,
                                                                         ``status``, ``duration``
``job_retried``    after ``job_failed``, when the job will run again     same as ``job_failed``
``job_dead``       after ``job_failed``, when the job will not           same as ``job_failed``
``job_cancelled``  after a running job ended cancelled (committed)       ``job``
``jobs_reaped``    after a reap that changed rows committed              ``repository``, ``table``,
                                                                         ``requeued``, ``dead``
=================  ====================================================  =========================

``job`` is the claimed job (a detached snapshot: ``attempts`` counts this
attempt); ``duration`` is the handler's run time in seconds; ``error`` is the
exception, or ``None`` for an unknown task or a deadline that passed; ``status`` is the job's new
status (``"pending"`` or ``"dead"``). Nothing is sent for work that was
rolled back or fenced out (a lost lease). Receivers run in the worker's
threads, so they must be thread-safe and quick; an exception in a receiver
is logged and never affects the job.
"""

from __future__ import annotations

import logging
from typing import Any

from blinker import NamedSignal, Namespace

log = logging.getLogger("sa_jobqueue.worker")

_signals = Namespace()

job_started: NamedSignal = _signals.signal("job-started", doc="A handler is about to run.")
job_succeeded: NamedSignal = _signals.signal("job-succeeded", doc="A job's completion committed.")
job_failed: NamedSignal = _signals.signal("job-failed", doc="A failed attempt was recorded.")
job_retried: NamedSignal = _signals.signal("job-retried", doc="A failed job will run again.")
job_dead: NamedSignal = _signals.signal("job-dead", doc="A failed job will not run again.")
job_cancelled: NamedSignal = _signals.signal("job-cancelled", doc="A running job ended cancelled.")
jobs_reaped: NamedSignal = _signals.signal("jobs-reaped", doc="A reap sent expired jobs back or to dead.")


def send(signal: NamedSignal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal``; a receiver's exception is logged, never raised."""
    if not signal.receivers:
        return
    try:
        signal.send(sender, **kwargs)
    except Exception:
        log.exception("a receiver of %s failed", signal.name)


def send_failure(sender: Any, job: Any, error: BaseException | None, status: str, duration: float) -> None:
    """``job_failed``, then ``job_dead`` or ``job_retried``."""
    send(job_failed, sender, job=job, error=error, status=status, duration=duration)
    send(job_dead if status == "dead" else job_retried, sender, job=job, error=error, status=status,
         duration=duration)


__all__ = [
    "job_cancelled", "job_dead", "job_failed", "job_retried", "job_started", "job_succeeded", "jobs_reaped", "send",
    "send_failure",
]
