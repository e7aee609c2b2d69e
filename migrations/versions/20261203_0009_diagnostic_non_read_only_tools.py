"""diagnostics: what to do with calls of tools that are not read_only (call, skip, dry_run)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 07:40:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0009'
down_revision: Union[str, None] = '0008'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('diagnostics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('non_read_only_tools', sa.String(length=16), server_default='call',
                                      nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('diagnostics', schema=None) as batch_op:
        batch_op.drop_column('non_read_only_tools')
