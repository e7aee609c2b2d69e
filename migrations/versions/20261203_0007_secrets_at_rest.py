"""secrets at rest: webhook signing secrets are stored sealed (wider columns), their hint beside them

Tool headers live inside the `method` JSON and need no schema change. This revision changes no
secret itself (sealing needs the key, which migrations do not hold): values stored before it stay
plain text, still read as they are, until `agent-rft secrets reencrypt` seals them. Going back
below it needs every secret in plain text again (`agent-rft secrets decrypt`), and says so.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 07:30:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0007'
down_revision: Union[str, None] = '0006'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

endpoints = sa.table('webhook_endpoints', sa.column('id', sa.String), sa.column('signing_secret', sa.Text),
                     sa.column('previous_signing_secret', sa.Text), sa.column('signing_secret_hint', sa.String))
runs = [sa.table(name, sa.column('method', sa.JSON)) for name in ('jobs', 'diagnostics')]


def upgrade() -> None:
    with op.batch_alter_table('webhook_endpoints', schema=None) as batch_op:
        batch_op.alter_column('signing_secret', existing_type=sa.String(length=128), type_=sa.Text(),
                              existing_nullable=False)
        batch_op.alter_column('previous_signing_secret', existing_type=sa.String(length=128), type_=sa.Text(),
                              existing_nullable=True)
        batch_op.add_column(sa.Column('signing_secret_hint', sa.String(length=64), nullable=True))
    conn = op.get_bind()
    # Every secret is still plain text here: its hint is the API's (app/webhooks/signing.secret_hint).
    for endpoint_id, secret in conn.execute(sa.select(endpoints.c.id, endpoints.c.signing_secret)).all():
        conn.execute(endpoints.update().where(endpoints.c.id == endpoint_id)
                     .values(signing_secret_hint=f"whsec_****{secret[-4:]}"))
    with op.batch_alter_table('webhook_endpoints', schema=None) as batch_op:
        batch_op.alter_column('signing_secret_hint', existing_type=sa.String(length=64), nullable=False)


def _sealed_count(conn: sa.Connection) -> int:
    sealed = conn.execute(sa.select(sa.func.count()).select_from(endpoints).where(sa.or_(
        endpoints.c.signing_secret.like('fernet:%'), endpoints.c.previous_signing_secret.like('fernet:%')))).scalar()
    for table in runs:
        for (method,) in conn.execute(sa.select(table.c.method)):
            tools = ((method or {}).get('reinforcement') or {}).get('tools') or []
            sealed += sum(isinstance(v, dict) for tool in tools for v in (tool.get('headers') or {}).values())
    return sealed


def downgrade() -> None:
    sealed = _sealed_count(op.get_bind())
    if sealed:
        raise RuntimeError(
            f"Stored secrets are encrypted ({sealed} found) and revision 0006 reads only plain text. Run "
            "`agent-rft secrets decrypt` (with the same AGENT_RFT_SECRET_KEYS) first, then downgrade again.")
    with op.batch_alter_table('webhook_endpoints', schema=None) as batch_op:
        batch_op.drop_column('signing_secret_hint')
        batch_op.alter_column('previous_signing_secret', existing_type=sa.Text(), type_=sa.String(length=128),
                              existing_nullable=True)
        batch_op.alter_column('signing_secret', existing_type=sa.Text(), type_=sa.String(length=128),
                              existing_nullable=False)
