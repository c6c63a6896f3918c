"""The `grpo-jobs` command group, on which each module of the CLI registers its commands."""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """Train language models with GRPO as jobs."""
