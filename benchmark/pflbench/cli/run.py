"""CLI: run sweep. Not built yet: each command says so and exits non-zero."""

import typer

from pflbench.errors import NotBuiltError


def register(app: typer.Typer) -> None:
    @app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _run() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench run' is not built yet")

    @app.command("sweep", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _sweep() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench sweep' is not built yet")

