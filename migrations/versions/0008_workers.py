"""the GPUs a job needs on one worker, and the registry of running workers

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Jobs stored before: 0, any worker (as they were routed); one that named a GPU fails on a CPU worker
    # with the devices.policy message, as it did.
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("gpus", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("hostname", sa.String(200), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_workers_seen_at", "workers", ["seen_at"])


def downgrade() -> None:
    op.drop_index("ix_workers_seen_at", table_name="workers")
    op.drop_table("workers")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("gpus")
