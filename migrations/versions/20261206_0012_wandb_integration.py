"""wandb integration: a job's `integrations`, a project's sealed Weights & Biases API key

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 12:00:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = '0012'
down_revision: Union[str, None] = '0011'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('integrations', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True))
    with op.batch_alter_table('projects', schema=None) as batch_op:
        batch_op.add_column(sa.Column('wandb_api_key', sa.Text(), nullable=True))


def downgrade() -> None:
    # The key is sealed and the integrations are only read by this revision's code: dropping both
    # loses nothing an older revision could use.
    with op.batch_alter_table('projects', schema=None) as batch_op:
        batch_op.drop_column('wandb_api_key')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('integrations')
