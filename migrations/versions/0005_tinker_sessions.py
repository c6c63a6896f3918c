"""tinker_sessions, session_ops and session_checkpoints: the tinker-compatible API's sessions and the operations (futures)
of session jobs

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tinker_sessions",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("sdk_version", sa.String(40), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_tinker_sessions_owner_created", "tinker_sessions", ["owner", "created_at"])
    op.create_table(
        "session_ops",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("request_id", sa.String(40), nullable=False),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(30), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("status", sa.String(10), nullable=False),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("result_format", sa.String(10), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("category", sa.String(10), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("request_id", name="uq_session_ops_request_id"),
    )
    op.create_index("ix_session_ops_job_status_seq", "session_ops", ["job_id", "status", "seq"])
    op.create_table(
        "session_checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("job_id", "kind", "name", name="uq_session_checkpoints_job_kind_name"),
    )


def downgrade() -> None:
    op.drop_table("session_checkpoints")
    op.drop_index("ix_session_ops_job_status_seq", table_name="session_ops")
    op.drop_table("session_ops")
    op.drop_index("ix_tinker_sessions_owner_created", table_name="tinker_sessions")
    op.drop_table("tinker_sessions")
