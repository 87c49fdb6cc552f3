"""CLI: `run` — one run (federated with user-level DP, Algorithm 1; or a reference or example-level
DP-SGD row) into a run directory."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from pflbench.cli.common import (
    DeviceOption,
    NprocOption,
    PluginOption,
    SpecsOption,
    check_device,
    console,
    processes,
    relaunch_under_torchrun,
)
from pflbench.errors import UserError


def _percent(result) -> str:
    return (
        "-"
        if result is None
        else f"{100 * result.wer:.1f} / "
        + ("-" if result.cer is None else f"{100 * result.cer:.1f}")
    )


def _epsilons(scale, per_example: bool = False) -> str:
    def one(name: str, claim) -> str:
        if claim is None:
            return f"{name} ∞"
        return f"{name} {claim.epsilon:.3g}" if claim.epsilon is not None else f"{name} n/a"

    text = ", ".join(one(name, claim) for name, claim in sorted(scale.epsilon.items()))
    k, s = ("N", "B") if per_example else ("K", "S")  # examples and batch, or users and cohort
    return f"({k}={scale.population:,}, {s}={scale.cohort:,}, T={scale.steps:,}): {text}"


def run_summary(run_dir: Path) -> list[str]:
    """A few lines a person reads at the end of `pflbench run`: WER/CER per eval set next to the
    seed model's, ε at the simulated and the extrapolated scale, wall time, where things are."""
    from pflbench.data.corpora import Skips
    from pflbench.data.prepare import skipped_summary
    from pflbench.progress import hms
    from pflbench.results.schema import load_record

    record, _ = load_record(run_dir / "record.json")
    seed = record.metrics.seed_model or {}
    width = max(len(name) for name in record.metrics.final)
    lines = [f"{'eval set':<{width}}  WER / CER % (seed model's)"]
    for name, result in sorted(record.metrics.final.items()):
        lines.append(f"{name:<{width}}  {_percent(result)}  ({_percent(seed.get(name))})")
    privacy = record.privacy
    deltas = {
        c.delta
        for s in (privacy.simulated, privacy.extrapolated) if s is not None
        for c in s.epsilon.values() if c is not None and c.delta is not None
    }  # fmt: skip
    delta = f" (δ = {', '.join(f'{d:g}' for d in sorted(deltas))})" if deltas else ""
    if not privacy.dp:
        lines.append("ε: ∞ (no DP budget: no noise is added)")
    per_example = privacy.unit == "example"
    for label, scale in (("simulated", privacy.simulated), ("extrapolated", privacy.extrapolated)):
        if privacy.dp and scale is not None and per_example:
            lines.append(
                f"ε per example{delta}, not per user, at the run's scale"
                f" {_epsilons(scale, per_example)}"
            )
        elif privacy.dp and scale is not None:
            lines.append(f"ε{delta} at the {label} scale {_epsilons(scale)}")
    audit = privacy.audit
    if audit is not None:  # compare with the simulated scale's ε (docs/PRIVACY.md)
        lines.append(
            f"privacy audit ({audit.canaries_inserted} canaries + {audit.canaries_held_out} held"
            f" out, δ = {audit.delta:g}): ε estimate {audit.epsilon_estimate:.3g}, lower bound"
            f" {audit.epsilon_lower_bound:.3g} ({100 * audit.confidence:g}% confidence)"
        )
    for split, skipped in sorted((record.data.skipped if record.data else {}).items()):
        summary = skipped_summary(Skips.from_dict(skipped))  # nothing silently dropped
        if summary:
            lines.append(f"data {split}{summary} (all in the record's data.skipped)")
    nonfinite = record.diagnostics.nonfinite_updates if record.diagnostics else 0
    if nonfinite:  # zeroed (a NaN/Inf update has no norm): say so, however few
        updates = sum(record.compute.cohort_per_step or [])
        lines.append(
            f"non-finite updates: {nonfinite} of {updates} were zeroed (NaN or Inf; the record's"
            " diagnostics.nonfinite_updates)"
        )
    wall = record.compute.wall_seconds
    if wall is not None:
        lines.append(f"wall time: {hms(wall)}" if wall >= 60 else f"wall time: {wall:.1f} s")
    lines += [f"run directory: {run_dir}", f"result record: {run_dir / 'record.json'}"]
    return lines


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        task: str = typer.Option(..., "--task", help="Task name (see `pflbench tasks list`)."),
        baseline: str = typer.Option(..., "--baseline", help="Baseline name."),
        budget: str = typer.Option(
            None,
            "--budget",
            help="Privacy budget name (default: the task's first budget for federated training"
            " that clips client updates, else none; example-level DP-SGD names its budget).",
        ),
        seed: int = typer.Option(0, "--seed", help="Run seed (cohorts, batches, noise)."),
        sets: list[str] = typer.Option(
            None,
            "--set",
            metavar="KEY.PATH=VALUE",
            help="Recipe override key.path=value (repeatable).",
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
        plugins: list[str] = PluginOption,
        nproc: int = NprocOption,
        parallel_clients: int = typer.Option(
            1,
            "--parallel-clients",
            min=1,
            help="Clients trained at once per process (vmap; small models without dropout; "
            "`pflbench bench fl --parallel-clients G` says whether it is faster).",
        ),
        compile_step: bool = typer.Option(
            False,
            "--compile/--no-compile",
            help="Compile the clients' local step with torch.compile (inductor; the loss under "
            "CUDA graphs on CUDA): the same run up to float rounding, stated in the record; "
            "`pflbench bench fl --compile` says whether it is faster.",
        ),
        audit_canaries: int = typer.Option(
            0,
            "--audit-canaries",
            min=0,
            help="Insert N canary users for an empirical privacy audit (docs/PRIVACY.md); sets"
            " privacy.audit_canaries, so the config hash says the run was audited.",
        ),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar."),
        checkpoint_every: int = typer.Option(
            10, "--checkpoint-every", min=1, help="Central steps between resumable checkpoints."
        ),
    ) -> None:
        """Prepare data, train or reuse the seed model, run the central steps, evaluate, and
        write the run directory with its result record."""
        from pflbench.cli.common import load_specs
        from pflbench.methods import check_run
        from pflbench.rundir import default_run_dir
        from pflbench.runner import RunOptions, run
        from pflbench.spec.resolve import default_budget, resolve

        check_device(device, processes=processes(nproc))
        if out is not None and resume is not None and out != resume:
            raise UserError("give either --out or --resume (the run directory to continue)")
        registry = load_specs(specs, plugins)
        sets = list(sets or [])
        if audit_canaries:
            sets.append(f"privacy.audit_canaries={audit_canaries}")
        budget = budget or default_budget(registry, task, baseline, sets)
        config = resolve(registry, task, baseline, budget, seed, sets)
        check_run(config)  # before torchrun starts any process
        relaunch_under_torchrun(nproc)
        run_dir = resume or out or default_run_dir(config)
        run_dir = run(
            config,
            out_dir=run_dir,
            resume=resume is not None,
            options=RunOptions(
                device=device,
                data_root=data_root,
                progress=progress,
                checkpoint_every=checkpoint_every,
                parallel_clients=parallel_clients,
                compile_backend="inductor" if compile_step else None,
            ),
        )
        if int(os.environ.get("RANK", "0")) == 0:
            for line in run_summary(run_dir):
                console.print(line, highlight=False, markup=False)
