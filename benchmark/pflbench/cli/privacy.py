"""CLI: privacy. Not built yet: each command says so and exits non-zero."""

import typer

from pflbench.errors import NotBuiltError


def register(app: typer.Typer) -> None:
    @app.command("privacy", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _privacy() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench privacy' is not built yet")

