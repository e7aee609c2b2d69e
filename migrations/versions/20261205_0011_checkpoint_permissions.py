"""checkpoint permissions: a project shares one of its checkpoints with another project

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 09:00:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0011'
down_revision: Union[str, None] = '0010'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('checkpoint_permissions',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('owner_project_id', sa.String(length=64), nullable=False),
    sa.Column('fine_tuned_model_checkpoint', sa.String(length=256), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['owner_project_id'], ['projects.id'], name=op.f('fk_checkpoint_permissions_owner_project_id_projects'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_checkpoint_permissions_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_checkpoint_permissions')),
    sa.UniqueConstraint('fine_tuned_model_checkpoint', 'project_id', name='uq_checkpoint_permissions_fine_tuned_model_checkpoint'),
    sa.UniqueConstraint('id', name=op.f('uq_checkpoint_permissions_id'))
    )
    with op.batch_alter_table('checkpoint_permissions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoint_permissions_owner_project_id'), ['owner_project_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_checkpoint_permissions_project_id'), ['project_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('checkpoint_permissions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoint_permissions_project_id'))
        batch_op.drop_index(batch_op.f('ix_checkpoint_permissions_owner_project_id'))

    op.drop_table('checkpoint_permissions')
