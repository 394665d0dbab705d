"""sa_jobqueue_jobs: the dashboard's index of jobs by status and queue.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 10:00:00.000000

* ``ix_sa_jobqueue_jobs_status_v1`` on ``(status, queue, id) WHERE status IN
  ('pending', 'done', 'dead', 'cancelled')`` (the running jobs are few, and a
  claim writes no entry in it): the dashboard's jobs list of a status (and
  queue) reads it newest first, its overview and its confirmations count
  through it, up to a limit.

It is built CONCURRENTLY, so workers keep claiming and enqueueing while
it builds; run inside a transaction its caller began, it is built in
that transaction instead (see
``sa_jobqueue.migrations.create_dashboard_indexes``).
"""

from collections.abc import Sequence

from sa_jobqueue.migrations import create_dashboard_indexes, drop_dashboard_indexes

# revision identifiers, used by Alembic.
revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_jobqueue_jobs"


def upgrade() -> None:
    create_dashboard_indexes(TABLE)


def downgrade() -> None:
    drop_dashboard_indexes(TABLE)
