"""sa_jobqueue_jobs: the claim index leads with queue (ix_sa_jobqueue_jobs_claim_v2).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 04:40:00.000000

``ix_sa_jobqueue_jobs_claim_v1`` on ``(priority, run_at, id)`` made a claim
from one queue walk every other queue's pending jobs; ``_v2`` on ``(queue,
priority, run_at, id)``, with the same predicate, lets it read its own
queue's runnable rows only (docs/concepts.md, "How a claim reads the table").
The new index is built CONCURRENTLY before the old one is dropped the same
way, so workers keep claiming and enqueueing throughout; this revision
commits the ones before it first. Run inside a transaction its caller began
(a connection handed over by ``config.attributes["connection"]``), both steps
run in that transaction instead, blocking writes while the index builds.
Code of this version needs ``_v2`` to claim fast, not to claim at all: it
runs, slower, on a table that still has ``_v1`` only.
"""

from collections.abc import Sequence

from sa_jobqueue.migrations import downgrade_claim_index, upgrade_claim_index

# revision identifiers, used by Alembic.
revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "sa_jobqueue_jobs"


def upgrade() -> None:
    upgrade_claim_index(TABLE)


def downgrade() -> None:
    downgrade_claim_index(TABLE)
