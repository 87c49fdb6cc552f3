"""CLI: submit leaderboard results plot. Not built yet: each command says so and exits non-zero."""

import typer

from pflbench.errors import NotBuiltError


def register(app: typer.Typer) -> None:
    @app.command("submit", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _submit() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench submit' is not built yet")

    @app.command("leaderboard", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _leaderboard() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench leaderboard' is not built yet")

    @app.command("results", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _results() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench results' is not built yet")

    @app.command("plot", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _plot() -> None:
        """(not built yet)"""
        raise NotBuiltError("'pflbench plot' is not built yet")

