"""jobs.uid: a globally unique id for artifacts and broker messages

Revision ID: 0002
Revises: 0001
"""
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("uid", sa.String(length=32), nullable=True))
    jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("uid", sa.String))
    conn = op.get_bind()
    for (job_id,) in conn.execute(sa.select(jobs.c.id)).all():
        conn.execute(jobs.update().where(jobs.c.id == job_id).values(uid=uuid.uuid4().hex))
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.alter_column("uid", existing_type=sa.String(length=32), nullable=False)
        batch_op.create_unique_constraint("uq_jobs_uid", ["uid"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_constraint("uq_jobs_uid", type_="unique")
        batch_op.drop_column("uid")
