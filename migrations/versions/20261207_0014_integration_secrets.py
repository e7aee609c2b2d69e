"""integration_secrets: a project's credentials keyed by integration type, replacing projects.wandb_api_key

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 02:00:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0014'
down_revision: Union[str, None] = '0013'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'integration_secrets',
        sa.Column('project_id', sa.String(length=64), nullable=False),
        sa.Column('integration', sa.String(length=32), nullable=False),
        sa.Column('sealed', sa.Text(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_integration_secrets_project_id_projects'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('project_id', 'integration', name=op.f('pk_integration_secrets')),
    )
    # The W&B keys move as they are (sealed or not: `agent-rft secrets encrypt` seals the rest).
    op.execute("INSERT INTO integration_secrets (project_id, integration, sealed, updated_at) "
               "SELECT id, 'wandb', wandb_api_key, CURRENT_TIMESTAMP FROM projects WHERE wandb_api_key IS NOT NULL")
    with op.batch_alter_table('projects') as batch_op:
        batch_op.drop_column('wandb_api_key')


def downgrade() -> None:
    with op.batch_alter_table('projects') as batch_op:
        batch_op.add_column(sa.Column('wandb_api_key', sa.Text(), nullable=True))
    op.execute("UPDATE projects SET wandb_api_key = (SELECT sealed FROM integration_secrets "
               "WHERE integration_secrets.project_id = projects.id AND integration = 'wandb')")
    op.drop_table('integration_secrets')
