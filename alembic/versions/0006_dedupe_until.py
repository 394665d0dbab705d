"""sa_jobqueue_jobs: the dedupe_until column (how long a job holds its dedupe key).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 22:50:00.000000

Adds one nullable ``varchar(16)``, NULL on every existing row: NULL means the
job holds its dedupe key while it is pending or running (what every job did
before); ``'started'`` means while it is pending only, and the claim that
starts the job clears its ``dedupe_key`` (``sa_jobqueue.dedupe``).

``ADD COLUMN`` of a nullable column without a default rewrites nothing; it
takes an ACCESS EXCLUSIVE lock for an instant. The code of this version
names the column in every claim: apply this revision first.
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_jobqueue_jobs"


def upgrade() -> None:
    op.add_column(TABLE, sa.Column("dedupe_until", sa.String(length=16), nullable=True))


def downgrade() -> None:
    op.drop_column(TABLE, "dedupe_until")
