"""CLI: data. Not built yet: each command says so and exits non-zero."""

import typer

from pflbench.errors import NotBuiltError


def register(app: typer.Typer) -> None:
    @app.command("data", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _data() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench data' is not built yet")

