"""webhooks: endpoints, the event outbox, deliveries and their attempt log

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 13:37:41.605729
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = '0004'
down_revision: Union[str, None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('webhook_endpoints',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('event_types', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('signing_secret', sa.String(length=128), nullable=False),
    sa.Column('previous_signing_secret', sa.String(length=128), nullable=True),
    sa.Column('previous_secret_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('disabled_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('disabled_reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_webhook_endpoints_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_webhook_endpoints')),
    sa.UniqueConstraint('id', name=op.f('uq_webhook_endpoints_id'))
    )
    with op.batch_alter_table('webhook_endpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhook_endpoints_project_id'), ['project_id'], unique=False)

    op.create_table('webhook_events',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('type', sa.String(length=128), nullable=False),
    sa.Column('payload', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_webhook_events_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_webhook_events')),
    sa.UniqueConstraint('id', name=op.f('uq_webhook_events_id'))
    )
    with op.batch_alter_table('webhook_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhook_events_project_id'), ['project_id'], unique=False)

    op.create_table('webhook_deliveries',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('event_id', sa.String(length=64), nullable=False),
    sa.Column('endpoint_id', sa.String(length=64), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('attempt_count', sa.Integer(), nullable=False),
    sa.Column('schedule_start', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('claim_id', sa.String(length=64), nullable=True),
    sa.Column('locked_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_status_code', sa.Integer(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoints.id'], name=op.f('fk_webhook_deliveries_endpoint_id_webhook_endpoints'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['event_id'], ['webhook_events.id'], name=op.f('fk_webhook_deliveries_event_id_webhook_events'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_webhook_deliveries')),
    sa.UniqueConstraint('id', name=op.f('uq_webhook_deliveries_id'))
    )
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhook_deliveries_endpoint_id'), ['endpoint_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_webhook_deliveries_event_id'), ['event_id'], unique=False)
        batch_op.create_index('ix_webhook_deliveries_state_next_attempt_at', ['state', 'next_attempt_at'], unique=False)

    op.create_table('webhook_attempts',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('delivery_id', sa.String(length=64), nullable=False),
    sa.Column('claim_id', sa.String(length=64), nullable=False),
    sa.Column('attempt_number', sa.Integer(), nullable=False),
    sa.Column('worker_id', sa.String(length=255), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('latency_ms', sa.Integer(), nullable=True),
    sa.Column('response_excerpt', sa.Text(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('outcome', sa.String(length=16), nullable=False),
    sa.ForeignKeyConstraint(['delivery_id'], ['webhook_deliveries.id'], name=op.f('fk_webhook_attempts_delivery_id_webhook_deliveries'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_webhook_attempts')),
    sa.UniqueConstraint('claim_id', name=op.f('uq_webhook_attempts_claim_id')),
    sa.UniqueConstraint('id', name=op.f('uq_webhook_attempts_id'))
    )
    with op.batch_alter_table('webhook_attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhook_attempts_delivery_id'), ['delivery_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('webhook_attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_webhook_attempts_delivery_id'))

    op.drop_table('webhook_attempts')
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.drop_index('ix_webhook_deliveries_state_next_attempt_at')
        batch_op.drop_index(batch_op.f('ix_webhook_deliveries_event_id'))
        batch_op.drop_index(batch_op.f('ix_webhook_deliveries_endpoint_id'))

    op.drop_table('webhook_deliveries')
    with op.batch_alter_table('webhook_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_webhook_events_project_id'))

    op.drop_table('webhook_events')
    with op.batch_alter_table('webhook_endpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_webhook_endpoints_project_id'))

    op.drop_table('webhook_endpoints')
