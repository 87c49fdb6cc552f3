"""CLI: tasks, baselines, budgets (being written)."""

import typer


def register(app: typer.Typer) -> None:
    pass
