"""sa_jobqueue_jobs: how long a job holds its dedupe key, and the index of dedupe windows.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 22:50:00.000000

* ``dedupe_until``, a nullable ``varchar(16)``, NULL on every existing row:
  NULL means the job holds its dedupe key while it is pending or running
  (what every job did before); ``'started'`` means while it is pending only,
  and the claim that starts the job clears its ``dedupe_key``
  (``sa_jobqueue.dedupe``). ``ADD COLUMN`` of a nullable column without a
  default rewrites nothing; it takes an ACCESS EXCLUSIVE lock for an instant.
  The code of this version names the column in every claim: apply this
  revision first.
* ``ix_sa_jobqueue_jobs_dedupe_done_v1`` on ``(queue, dedupe_key,
  created_at) WHERE dedupe_key IS NOT NULL AND status = 'done'``, where an
  enqueue with a dedupe window finds its key's finished jobs. It is built
  CONCURRENTLY (the column is committed first), so workers keep claiming and
  enqueueing; run inside a transaction its caller began, it is built in that
  transaction instead (see ``sa_jobqueue.migrations.create_dedupe_done_index``).
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from sa_jobqueue.migrations import create_dedupe_done_index, drop_dedupe_done_index

# revision identifiers, used by Alembic.
revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_jobqueue_jobs"


def upgrade() -> None:
    op.add_column(TABLE, sa.Column("dedupe_until", sa.String(length=16), nullable=True))
    create_dedupe_done_index(TABLE)


def downgrade() -> None:
    drop_dedupe_done_index(TABLE)
    op.drop_column(TABLE, "dedupe_until")
