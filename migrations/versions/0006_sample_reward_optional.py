"""samples.reward may be empty: a session run's samples are graded by the client, not by the service

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch_op:
        batch_op.alter_column("reward", existing_type=sa.Float(), nullable=True)


def downgrade() -> None:
    op.execute("UPDATE samples SET reward = 'NaN' WHERE reward IS NULL")
    with op.batch_alter_table("samples") as batch_op:
        batch_op.alter_column("reward", existing_type=sa.Float(), nullable=False)
