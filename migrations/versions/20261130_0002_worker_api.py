"""worker api: job leases and resume state, step metrics, rollouts, event keys, checkpoint paths

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 11:53:17.316893
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = '0002'
down_revision: Union[str, None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('job_metrics',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_metrics_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_job_metrics')),
    sa.UniqueConstraint('job_id', 'key', 'step', name='uq_job_metrics_job_key_step')
    )
    op.create_table('job_rollouts',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('split', sa.String(length=8), nullable=False),
    sa.Column('trace_id', sa.String(length=128), nullable=False),
    sa.Column('sample_index', sa.Integer(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('finish_reason', sa.String(length=64), nullable=True),
    sa.Column('tool_calls', sa.Integer(), nullable=False),
    sa.Column('data', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_rollouts_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_job_rollouts')),
    sa.UniqueConstraint('job_id', 'trace_id', name='uq_job_rollouts_job_trace')
    )
    with op.batch_alter_table('job_rollouts', schema=None) as batch_op:
        batch_op.create_index('ix_job_rollouts_job_step', ['job_id', 'step'], unique=False)

    op.create_table('job_steps',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('data', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_steps_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_job_steps')),
    sa.UniqueConstraint('job_id', 'step', name='uq_job_steps_job_step')
    )
    op.create_table('worker_event_keys',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('event_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_worker_event_keys_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_worker_event_keys')),
    sa.UniqueConstraint('job_id', 'key', name='uq_worker_event_keys_job_key')
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('path', sa.Text(), nullable=True))

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lease_id', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('lease_owner', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('released_lease_id', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('resume_state', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('completed_steps', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('resolved_hyperparameters', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('resolved_hyperparameters')
        batch_op.drop_column('completed_steps')
        batch_op.drop_column('resume_state')
        batch_op.drop_column('released_lease_id')
        batch_op.drop_column('lease_expires_at')
        batch_op.drop_column('lease_owner')
        batch_op.drop_column('lease_id')

    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_column('path')

    op.drop_table('worker_event_keys')
    op.drop_table('job_steps')
    with op.batch_alter_table('job_rollouts', schema=None) as batch_op:
        batch_op.drop_index('ix_job_rollouts_job_step')

    op.drop_table('job_rollouts')
    op.drop_table('job_metrics')