"""serving: fine-tuned models can be deleted; model names are looked up by the chat-completions route

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 22:30:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0006'
down_revision: Union[str, None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('model_deleted_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index('ix_jobs_fine_tuned_model', ['fine_tuned_model'], unique=False)
    op.create_index('ix_checkpoints_fine_tuned_model_checkpoint', 'checkpoints', ['fine_tuned_model_checkpoint'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_checkpoints_fine_tuned_model_checkpoint', table_name='checkpoints')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_fine_tuned_model')
        batch_op.drop_column('model_deleted_at')
