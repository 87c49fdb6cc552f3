"""`pflbench sweep`: run a grid of (baseline × budget × seed) for one task, then plot it.

Each run is `python -m pflbench run ... --out RUN_DIR` in a subprocess (a crash in one run cannot
take the sweep down). A run folder with a DONE marker is finished and skipped on a rerun.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pflbench.results.plots import PlotReport, plot_results, plot_run
from pflbench.results.schema import load_record, safe_name


@dataclass(frozen=True)
class PlannedRun:
    task: str
    baseline: str
    budget: str
    seed: int
    sets: tuple[str, ...]
    run_dir: Path
    run_args: tuple[str, ...] = ()  # passed through to every run: --device, --data-root, --specs

    @property
    def done(self) -> bool:
        return (self.run_dir / "DONE").is_file()

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pflbench", "run", "--task", self.task]
        cmd += ["--baseline", self.baseline, "--budget", self.budget, "--seed", str(self.seed)]
        for item in self.sets:
            cmd += ["--set", item]
        return cmd + ["--out", str(self.run_dir), *self.run_args]


@dataclass
class SweepReport:
    finished: list[PlannedRun] = field(default_factory=list)
    skipped: list[PlannedRun] = field(default_factory=list)  # already DONE
    failed: list[tuple[PlannedRun, int]] = field(default_factory=list)  # (run, exit code)
    plots: PlotReport = field(default_factory=PlotReport)


def plan_sweep(
    task: str,
    baselines: list[str],
    budgets: list[str],
    seeds: list[int],
    sets: list[str],
    out_root: Path,
    run_args: tuple[str, ...] = (),
) -> list[PlannedRun]:
    """The grid in a fixed order; --set overrides give the folder a short hash suffix."""
    safe_name(task, "task")
    suffix = "__" + hashlib.sha256("\n".join(sets).encode()).hexdigest()[:8] if sets else ""
    return [
        PlannedRun(
            task,
            safe_name(baseline, "baseline"),
            safe_name(budget, "budget"),
            seed,
            tuple(sets),
            Path(out_root) / task / f"{baseline}__{budget}__seed{seed}{suffix}",
            run_args,
        )
        for baseline in baselines
        for budget in budgets
        for seed in seeds
    ]


def run_sweep(plan: list[PlannedRun], plot_dir: Path) -> SweepReport:
    report = SweepReport()
    for run in plan:
        if run.done:
            report.skipped.append(run)
            continue
        code = subprocess.run(run.command(), check=False).returncode
        if code == 0 and run.done:
            report.finished.append(run)
        else:
            report.failed.append((run, code))
    report.plots = plot_sweep(plan, plot_dir)
    return report


def plot_sweep(plan: list[PlannedRun], plot_dir: Path) -> PlotReport:
    """Result figures over the grid's finished records, and each finished run's own figures."""
    finished = [run for run in plan if run.done]
    records = [load_record(run.run_dir / "record.json")[0] for run in finished]
    report = plot_results(records, plot_dir) if records else PlotReport()
    for run in finished:
        plot_run(run.run_dir, plot_dir / "runs", report)
    return report
