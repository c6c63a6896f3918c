"""Alembic environment: migrates the URL the caller configured (see service.store.migrate)."""

from alembic import context
from sqlalchemy import engine_from_config, pool

from service.store.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = engine_from_config(config.get_section(config.config_ini_section, {}),
                                     prefix="sqlalchemy.", poolclass=pool.NullPool)
    with connectable.connect() as connection:
        # batch mode lets later migrations alter SQLite tables
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":  # several API processes start at once: one migrates,
                # the others wait here and then find the store at head (SQLite's own lock serialises them)
                connection.exec_driver_sql("SELECT pg_advisory_xact_lock(72616501)")
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
