"""Small pieces every CLI module shares: the console, JSON output and spec loading options."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from pflbench.errors import UserError

# Pipes and CI logs get a fixed, wide layout instead of rich's 80-column fallback.
_WIDTH = None if sys.stdout.isatty() else 140
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)

SpecsOption = typer.Option(
    None,
    "--specs",
    metavar="DIR",
    help="Extra folder(s) of task/baseline/budget YAMLs (also PFLBENCH_SPECS, ':'-separated).",
)
PluginOption = typer.Option(
    None,
    "--plugin",
    metavar="PATH_OR_MODULE",
    help="A plug-in to load: a .py file or a module that registers methods (repeatable; also "
    "PFLBENCH_PLUGINS, os.pathsep-separated, and the `pflbench.plugins` entry points).",
)
JsonOption = typer.Option(False, "--json", help="Machine-readable JSON output.")
DeviceOption = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N.")
NprocOption = typer.Option(1, "--nproc", min=1, help="Processes to launch via torchrun.")


def processes(nproc: int) -> int:
    """The processes a command runs in: --nproc, or torchrun's WORLD_SIZE under torchrun."""
    return max(nproc, int(os.environ.get("WORLD_SIZE", "1")))


def _torchrun_argv(nproc: int) -> list[str]:
    """This command again under torchrun, without --nproc (each rank then runs one process)."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        args.append(arg)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc_per_node={nproc}", "-m", "pflbench", *args]


def relaunch_under_torchrun(nproc: int) -> None:
    """With --nproc N > 1 outside torchrun: run this command again as N torchrun processes and
    exit with torchrun's status."""
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        sys.exit(subprocess.call(_torchrun_argv(nproc)))


def check_device(device: str, processes: int = 1) -> str:
    """--device: cpu, cuda (the current GPU; under torchrun each process's own) or cuda:N (that
    GPU, for one process only)."""
    import torch

    if device not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise UserError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if device == "cpu":
        return device
    if not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU is available to torch on this machine")
    if ":" in device:
        index, count = int(device.split(":")[1]), torch.cuda.device_count()
        if index >= count:
            raise UserError(f"--device {device}: torch sees {count} GPU(s), numbered from cuda:0")
        if processes > 1:
            raise UserError(
                f"--device {device}: with {processes} processes each takes the GPU of its local "
                "rank; give --device cuda"
            )
    return device


def extra_spec_dirs(specs: list[Path] | None) -> list[Path]:
    dirs = list(specs or [])
    env = os.environ.get("PFLBENCH_SPECS", "")
    dirs += [Path(p) for p in env.split(os.pathsep) if p]
    return dirs


def print_json(obj: Any) -> None:
    # Plain stdout, no rich markup, so the output is valid JSON for pipes.
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def load_specs(specs: list[Path] | None, plugins: list[str] | None = None):
    """Plug-ins loaded (entry points, PFLBENCH_PLUGINS, --plugin), then the spec registry with
    every name in it checked against the registries they fill."""
    from pflbench.methods import load_specs as load_checked_specs
    from pflbench.plugins import load_plugins

    load_plugins(plugins)
    return load_checked_specs(extra_spec_dirs(specs))
