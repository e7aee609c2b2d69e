"""evals: evals (item schema, testing criteria), their runs (leased like jobs) and output items

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07 18:40:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql


revision: str = '0015'
down_revision: Union[str, None] = '0014'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    op.create_table('evals',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('data_source_config', JSON, nullable=False),
    sa.Column('testing_criteria', JSON, nullable=False),
    sa.Column('metadata', JSON, nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_evals_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_evals')),
    sa.UniqueConstraint('id', name=op.f('uq_evals_id'))
    )
    with op.batch_alter_table('evals', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_evals_project_id'), ['project_id'], unique=False)

    op.create_table('eval_runs',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('eval_id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('data_source', JSON, nullable=False),
    sa.Column('metadata', JSON, nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('error', JSON, nullable=True),
    sa.Column('items_total', sa.Integer(), nullable=True),
    sa.Column('result', JSON, nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('enqueued_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('lease_id', sa.String(length=64), nullable=True),
    sa.Column('lease_owner', sa.String(length=255), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('released_lease_id', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['eval_id'], ['evals.id'], name=op.f('fk_eval_runs_eval_id_evals'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_eval_runs_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_eval_runs')),
    sa.UniqueConstraint('id', name=op.f('uq_eval_runs_id'))
    )
    with op.batch_alter_table('eval_runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_eval_runs_eval_id'), ['eval_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_eval_runs_project_id'), ['project_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_eval_runs_status'), ['status'], unique=False)

    op.create_table('eval_output_items',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('eval_id', sa.String(length=64), nullable=False),
    sa.Column('item_index', sa.Integer(), nullable=False),
    sa.Column('sample_index', sa.Integer(), nullable=False),
    sa.Column('trace_id', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('datasource_item', JSON, nullable=False),
    sa.Column('results', JSON, nullable=False),
    sa.Column('sample', JSON, nullable=False),
    sa.Column('trajectory', JSON, nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['eval_runs.id'], name=op.f('fk_eval_output_items_run_id_eval_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_eval_output_items')),
    sa.UniqueConstraint('id', name=op.f('uq_eval_output_items_id')),
    sa.UniqueConstraint('run_id', 'item_index', 'sample_index', name='uq_eval_output_items_run_item')
    )
    with op.batch_alter_table('eval_output_items', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_eval_output_items_run_id'), ['run_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('eval_output_items', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_eval_output_items_run_id'))

    op.drop_table('eval_output_items')
    with op.batch_alter_table('eval_runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_eval_runs_status'))
        batch_op.drop_index(batch_op.f('ix_eval_runs_project_id'))
        batch_op.drop_index(batch_op.f('ix_eval_runs_eval_id'))

    op.drop_table('eval_runs')
    with op.batch_alter_table('evals', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_evals_project_id'))

    op.drop_table('evals')
