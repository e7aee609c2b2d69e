"""dashboard: an index for the rollout browser's sample filter

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 14:00:00.000000
"""
from typing import Sequence, Union

from alembic import op

revision: str = '0005'
down_revision: Union[str, None] = '0004'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_index('ix_job_rollouts_job_sample', 'job_rollouts', ['job_id', 'sample_index', 'step'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_job_rollouts_job_sample', table_name='job_rollouts')
