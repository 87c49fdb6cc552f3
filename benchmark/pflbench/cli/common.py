"""Small pieces every CLI module shares: the console, JSON output and spec loading options."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

# Pipes and CI logs get a fixed, wide layout instead of rich's 80-column fallback.
_WIDTH = None if sys.stdout.isatty() else 140
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)

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
