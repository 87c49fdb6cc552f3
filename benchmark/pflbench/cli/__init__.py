"""The `pflbench` command: a thin typer app that parses, calls the library and prints."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from pflbench import __version__
from pflbench.cli.common import err_console
from pflbench.errors import UserError

app = typer.Typer(
    name="pflbench",
    help="Benchmark private federated learning (user-level DP) for speech recognition.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_debug = False


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    # Eager: it answers while the arguments are parsed, before a command is asked for.
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    global _debug
    _debug = debug


def _register() -> None:
    # Imported here so `pflbench --help` lists every group in a fixed order.
    from pflbench.cli import bench, data, model, privacy, results, run, specs

    specs.register(app)
    privacy.register(app)
    data.register(app)
    model.register(app)
    run.register(app)
    results.register(app)
    bench.register(app)


_register()


def main() -> None:
    # Standalone mode: click handles usage errors (exit 2) and --help; UserErrors reach us here.
    try:
        app()
    except UserError as exc:
        if _debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        sys.exit(2)
