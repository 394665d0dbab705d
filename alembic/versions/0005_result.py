"""sa_jobqueue_jobs: the result and meta columns (what a handler returned; what travels with a job).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 19:40:00.000000

Adds two nullable ``jsonb`` columns, NULL on every existing row:

* ``result``: on a table that keeps finished jobs the worker stores there
  what the handler returned, in the transaction that completes the job (see
  ``sa_jobqueue.results``);
* ``meta``: what travels with a job besides its payload, written at enqueue
  (the trace context of the enqueuing code, for one).

``ADD COLUMN`` of a nullable column without a default rewrites nothing; it
takes an ACCESS EXCLUSIVE lock for an instant. The code of this version reads
both columns in every claim: apply this revision first.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_jobqueue_jobs"


def upgrade() -> None:
    op.add_column(TABLE, sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column(TABLE, sa.Column("meta", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column(TABLE, "meta")
    op.drop_column(TABLE, "result")
