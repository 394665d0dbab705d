"""A ready-made job table, ``sa_jobqueue_jobs``, on its own ``Base``.

For apps that need one job table and no columns of their own::

    from sa_jobqueue.default import Job
    jobs = JobRepository(Job)

The project's Alembic revisions (``alembic upgrade head``) create this table.
"""

from __future__ import annotations

from sqlalchemy.orm import DeclarativeBase

from .mixin import JobMixin


class Base(DeclarativeBase):
    """The declarative base of the default job table (its MetaData is the
    target of the project's own Alembic environment)."""


class Job(JobMixin, Base):
    """The default job model."""

    __tablename__ = "sa_jobqueue_jobs"
