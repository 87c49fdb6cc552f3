"""CLI: seed eval. Not built yet: each command says so and exits non-zero."""

import typer

from pflbench.errors import NotBuiltError


def register(app: typer.Typer) -> None:
    @app.command("seed", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _seed() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench seed' is not built yet")

    @app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _eval() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench eval' is not built yet")

