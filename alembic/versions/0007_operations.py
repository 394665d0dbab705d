"""Operations: the workers' presence, paused queues, throughput, and the progress of a running job.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 07:10:00.000000

* ``sa_jobqueue_workers``: one row per running worker process, refreshed by
  its presence beat every ``heartbeat_interval`` (``sa_jobqueue.presence``).
* ``sa_jobqueue_paused_queues``: one row per paused queue of a job table;
  workers leave it out of their claims within one poll interval
  (``sa_jobqueue.pausing``).
* ``sa_jobqueue_throughput``: per job table, queue and minute, the jobs
  workers completed and the attempts that failed, added by their presence
  beats (``sa_jobqueue.throughput``): the dashboard's throughput chart.
* ``sa_jobqueue_jobs.progress``: a nullable ``jsonb`` column, NULL on every
  existing row: how far a running job is, written by its heartbeat
  (``sa_jobqueue.progress``).

``ADD COLUMN`` of a nullable column without a default rewrites nothing; it
takes an ACCESS EXCLUSIVE lock for an instant. The code of this version reads
``progress`` in every claim: apply this revision first. Autogenerate writes
the same ``add_column`` for the job tables of an application.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_jobqueue_jobs"
WORKERS = "sa_jobqueue_workers"
PAUSED = "sa_jobqueue_paused_queues"
THROUGHPUT = "sa_jobqueue_throughput"


def upgrade() -> None:
    op.create_table(
        WORKERS,
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("driver", sa.String(length=16), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("tables", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("queues", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("beat_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("running", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        PAUSED,
        sa.Column("job_table", sa.String(length=63), nullable=False),
        sa.Column("queue", sa.String(length=128), nullable=False),
        sa.Column("paused_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("paused_by", sa.String(length=255), nullable=True),
        sa.PrimaryKeyConstraint("job_table", "queue"),
    )
    op.create_table(
        THROUGHPUT,
        sa.Column("job_table", sa.String(length=63), nullable=False),
        sa.Column("queue", sa.String(length=128), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("job_table", "queue", "minute"),
    )
    op.add_column(TABLE, sa.Column("progress", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column(TABLE, "progress")
    op.drop_table(THROUGHPUT)
    op.drop_table(PAUSED)
    op.drop_table(WORKERS)
