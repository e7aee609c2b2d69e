"""variance diagnostics: diagnostics, their rollouts, and the job's diagnostic_id

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 13:33:52.679413
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: Union[str, None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('diagnostics',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=True),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('training_file', sa.String(length=64), nullable=False),
    sa.Column('method', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('runs_per_sample', sa.Integer(), nullable=False),
    sa.Column('max_samples', sa.Integer(), nullable=True),
    sa.Column('seed', sa.Integer(), nullable=False),
    sa.Column('metadata', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('error', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('samples_total', sa.Integer(), nullable=True),
    sa.Column('samples_done', sa.Integer(), server_default='0', nullable=False),
    sa.Column('rollouts_done', sa.Integer(), server_default='0', nullable=False),
    sa.Column('load_basis', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('result', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('enqueued_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('lease_id', sa.String(length=64), nullable=True),
    sa.Column('lease_owner', sa.String(length=255), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('released_lease_id', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_diagnostics_job_id_jobs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_diagnostics_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_diagnostics')),
    sa.UniqueConstraint('id', name=op.f('uq_diagnostics_id'))
    )
    with op.batch_alter_table('diagnostics', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_diagnostics_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_diagnostics_project_id'), ['project_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_diagnostics_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_diagnostics_training_file'), ['training_file'], unique=False)

    op.create_table('diagnostic_rollouts',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('diagnostic_id', sa.String(length=64), nullable=False),
    sa.Column('trace_id', sa.String(length=128), nullable=False),
    sa.Column('sample_index', sa.Integer(), nullable=False),
    sa.Column('run_index', sa.Integer(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('finish_reason', sa.String(length=64), nullable=True),
    sa.Column('tool_calls', sa.Integer(), nullable=False),
    sa.Column('data', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['diagnostic_id'], ['diagnostics.id'], name=op.f('fk_diagnostic_rollouts_diagnostic_id_diagnostics'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_diagnostic_rollouts')),
    sa.UniqueConstraint('diagnostic_id', 'sample_index', 'run_index', name='uq_diagnostic_rollouts_diagnostic_run'),
    sa.UniqueConstraint('diagnostic_id', 'trace_id', name='uq_diagnostic_rollouts_diagnostic_trace')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('diagnostic_id', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('diagnostic_id')

    op.drop_table('diagnostic_rollouts')
    with op.batch_alter_table('diagnostics', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_diagnostics_training_file'))
        batch_op.drop_index(batch_op.f('ix_diagnostics_status'))
        batch_op.drop_index(batch_op.f('ix_diagnostics_project_id'))
        batch_op.drop_index(batch_op.f('ix_diagnostics_job_id'))

    op.drop_table('diagnostics')
