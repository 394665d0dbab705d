"""sa_jobqueue: job queues on PostgreSQL tables, for SQLAlchemy 2.x apps.

::

    class EmailJob(JobMixin, Base):
        __tablename__ = "email_jobs"

    emails = JobRepository(EmailJob)
    tasks = TaskRegistry()

    @tasks.task
    def send_welcome(job, session): ...

    with Session(engine) as session, session.begin():
        emails.enqueue(session, "send_welcome", {"user_id": 42})

    Worker(engine, emails, tasks).run()
"""

from .configured import ConfiguredTask
from .control_tables import create_control_tables
from .dedupe import Dedupe, EnqueueOutcome
from .errors import (
    InvalidArgumentError,
    JobFailedError,
    JobLostError,
    JobNotFoundError,
    JobQueueError,
    JobTableError,
    ResultNotReadyError,
    ResultTimeoutError,
    RetryJob,
    WorkerStuckError,
)
from .job_context import JobContext
from .middleware import HandlerCall
from .mixin import JobMixin, job_table_args
from .pausing import pause_queue, paused_queues, resume_queue
from .periodic import Periodic, PeriodicScheduler, create_periodic_table
from .presence import WorkerPresence, list_workers
from .progress import Progress, progress_of, report_progress
from .registry import TaskRegistry
from .reports import LeaseReport, QueueStats, ReapResult
from .repository import JobRepository
from .results import read_result, wait_for_result
from .retry import RetryPolicy
from .spec import JobSpec
from .states import STATUSES
from .task import Task
from .urls import psycopg_url
from .worker.books import WorkerResult
from .worker.threaded import Worker

__version__ = "0.1.0"

__all__ = [
    "STATUSES",
    "ConfiguredTask",
    "Dedupe",
    "EnqueueOutcome",
    "HandlerCall",
    "InvalidArgumentError",
    "JobContext",
    "JobFailedError",
    "JobLostError",
    "JobNotFoundError",
    "JobMixin",
    "JobQueueError",
    "JobRepository",
    "JobSpec",
    "JobTableError",
    "LeaseReport",
    "Periodic",
    "PeriodicScheduler",
    "Progress",
    "QueueStats",
    "ReapResult",
    "ResultNotReadyError",
    "ResultTimeoutError",
    "RetryJob",
    "RetryPolicy",
    "Task",
    "TaskRegistry",
    "Worker",
    "WorkerPresence",
    "WorkerResult",
    "WorkerStuckError",
    "create_control_tables",
    "create_periodic_table",
    "job_table_args",
    "list_workers",
    "pause_queue",
    "paused_queues",
    "progress_of",
    "psycopg_url",
    "read_result",
    "report_progress",
    "resume_queue",
    "wait_for_result",
]
