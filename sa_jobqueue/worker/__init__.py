"""The worker: claims jobs, runs each with a session of its own, finishes them.

The job lifecycle is written once, as small pieces that decide and act;
the thread driver (:mod:`~sa_jobqueue.worker.threaded`) schedules them.
See docs/architecture.md for the modules and the path of one job.
"""

from .books import WorkerResult
from .threaded import Worker

__all__ = ["Worker", "WorkerResult"]
