"""grader headers at rest: the header values of graders stored in jobs' and diagnostics' `method`
are sealed, as tool headers are since 0007

No schema change: the values live inside the `method` JSON. Until this revision they were stored
in plain text (and shown by the API); it seals the ones already stored under the newest key of
AGENT_RFT_SECRET_KEYS (the embedded SQLite default: its generated key), read from the settings as
`agent-rft db upgrade` sees them. A database without plain grader headers needs no key. Going
back opens them again with the same key, since revision 0009 reads them only in plain text.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 09:00:00.000000
"""
from collections.abc import Callable
from typing import Any, Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from app.core.config import get_settings
from app.core.crypto import SecretBox, secret_box
from app.jobs.tool_headers import StoredHeader, header_values, reseal_headers, unseal_headers

revision: str = '0010'
down_revision: Union[str, None] = '0009'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), 'postgresql')
runs = [sa.table(name, sa.column('id', sa.String), sa.column('method', JSON)) for name in ('jobs', 'diagnostics')]
Rewrite = Callable[[dict[str, Any], SecretBox], tuple[dict[str, Any], int]]


def _rewrite_grader_headers(to_rewrite: Callable[[StoredHeader], bool], rewrite: Rewrite) -> None:
    """Every job's and diagnostic's method that holds a grader header value `to_rewrite`, rewritten."""
    conn = op.get_bind()
    found = [(table, row_id, method) for table in runs
             for row_id, method in conn.execute(sa.select(table.c.id, table.c.method)).all()
             if method and any(map(to_rewrite, header_values(method, graders_only=True)))]
    if not found:
        return  # the key is read only when there is something to seal or open
    box = secret_box(get_settings())
    for table, row_id, method in found:
        new, changed = rewrite(method, box)
        if changed:
            conn.execute(table.update().where(table.c.id == row_id).values(method=new))


def upgrade() -> None:
    _rewrite_grader_headers(lambda stored: isinstance(stored, str),  # plain text
                            lambda method, box: reseal_headers(method, box, graders_only=True))


def downgrade() -> None:
    _rewrite_grader_headers(lambda stored: isinstance(stored, dict),  # sealed
                            lambda method, box: unseal_headers(method, box, graders_only=True))
