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
from .periodic import Periodic, PeriodicScheduler, create_periodic_table
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
    "QueueStats",
    "ReapResult",
    "ResultNotReadyError",
    "ResultTimeoutError",
    "RetryJob",
    "RetryPolicy",
    "Task",
    "TaskRegistry",
    "Worker",
    "WorkerResult",
    "WorkerStuckError",
    "create_periodic_table",
    "job_table_args",
    "psycopg_url",
    "read_result",
    "wait_for_result",
]
