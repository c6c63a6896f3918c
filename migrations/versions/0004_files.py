"""files: uploaded data files (their bytes live in the artifact store)

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("pk", sa.Integer(), primary_key=True),
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("purpose", sa.String(20), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("format", sa.String(20), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("columns", sa.JSON(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("id", name="uq_files_id"),
    )
    op.create_index("ix_files_owner_pk", "files", ["owner", "pk"])


def downgrade() -> None:
    op.drop_index("ix_files_owner_pk", table_name="files")
    op.drop_table("files")
