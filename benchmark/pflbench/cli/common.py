"""Small pieces every CLI module shares: the console, JSON output and spec loading options."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)

SpecsOption = typer.Option(
    None,
    "--specs",
    help="Extra folder(s) of task/baseline/budget YAMLs (also PFLBENCH_SPECS, ':'-separated).",
)
JsonOption = typer.Option(False, "--json", help="Machine-readable JSON output.")


def extra_spec_dirs(specs: list[Path] | None) -> list[Path]:
    dirs = list(specs or [])
    env = os.environ.get("PFLBENCH_SPECS", "")
    dirs += [Path(p) for p in env.split(os.pathsep) if p]
    return dirs


def print_json(obj: Any) -> None:
    # Plain stdout, no rich markup, so the output is valid JSON for pipes.
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))
