"""CLI: `run` — one federated run (Algorithm 1 with user-level DP) into a run directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer

from pflbench.cli.common import DeviceOption, SpecsOption, check_device, console, extra_spec_dirs
from pflbench.errors import UserError


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


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        task: str = typer.Option(..., "--task", help="Task name (see `pflbench tasks`)."),
        baseline: str = typer.Option(..., "--baseline", help="Baseline name."),
        budget: str = typer.Option(
            None,
            "--budget",
            help="Privacy budget name (default: the task's first budget for a baseline that can"
            " run under DP, else none).",
        ),
        seed: int = typer.Option(0, "--seed", help="Run seed (cohorts, batches, noise)."),
        sets: list[str] = typer.Option(
            None, "--set", help="Recipe override key.path=value (repeatable)."
        ),
        device: str = DeviceOption,
        out: Path = typer.Option(
            None,
            "--out",
            help="Run directory (default runs/<task>/<baseline>/<budget>/seed<N>-<hash8>).",
        ),
        resume: Path = typer.Option(
            None, "--resume", help="Continue the run in this directory from its last checkpoint."
        ),
        data_root: Path = typer.Option(
            None, "--data-root", help="Folder with the real corpora (also PFLBENCH_DATA)."
        ),
        specs: list[Path] = SpecsOption,
        nproc: int = typer.Option(1, "--nproc", min=1, help="Processes to launch via torchrun."),
        parallel_clients: int = typer.Option(
            1,
            "--parallel-clients",
            min=1,
            help="Clients trained at once per process (vmap; small models without dropout; "
            "`pflbench bench fl --parallel-clients G` says whether it is faster).",
        ),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar."),
        checkpoint_every: int = typer.Option(
            10, "--checkpoint-every", min=1, help="Central steps between resumable checkpoints."
        ),
    ) -> None:
        """Prepare data, train or reuse the seed model, run the central steps, evaluate, and
        write the run directory with its result record."""
        from pflbench.runner import check_privacy, default_run_dir, run
        from pflbench.spec.registry import load_registry
        from pflbench.spec.resolve import default_budget, resolve

        check_device(device, processes=max(nproc, int(os.environ.get("WORLD_SIZE", "1"))))
        if out is not None and resume is not None and out != resume:
            raise UserError("give either --out or --resume (the run directory to continue)")
        registry = load_registry(extra_spec_dirs(specs))
        budget = budget or default_budget(registry, task, baseline, sets or [])
        config = resolve(registry, task, baseline, budget, seed, sets or [])
        check_privacy(config)  # before torchrun starts any process
        if nproc > 1 and "WORLD_SIZE" not in os.environ:
            sys.exit(subprocess.call(_torchrun_argv(nproc)))
        run_dir = resume or out or default_run_dir(config)
        run_dir = run(
            config,
            out_dir=run_dir,
            resume=resume is not None,
            device=device,
            data_root=data_root,
            progress=progress,
            checkpoint_every=checkpoint_every,
            parallel_clients=parallel_clients,
        )
        if int(os.environ.get("RANK", "0")) == 0:
            console.print(f"run directory: {run_dir}")
            console.print(f"result record: {run_dir / 'record.json'}")
