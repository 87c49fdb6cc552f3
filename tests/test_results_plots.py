"""Plots (non-empty images of the expected size, byte-identical reruns), Parquet export, sweeps."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import matplotlib.image
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.results.export import export_parquet
from pflbench.results.leaderboard import load_results
from pflbench.results.plots import plot_results, plot_run
from pflbench.results.sweep import (
    PlannedRun,
    load_sweep_file,
    plan_sweep,
    plan_sweep_file,
    run_sweep,
)

REPO = Path(__file__).parents[1]
GOLDEN = Path(__file__).parent / "fixtures" / "results" / "golden" / "results"


@pytest.fixture
def paper_results(tmp_path) -> Path:
    """A results root holding only the repository's paper reference rows (not its run rows)."""
    root = tmp_path / "paper-results"
    shutil.copytree(REPO / "results" / "paper", root / "paper")
    return root


def assert_image(path: Path) -> None:
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (500, 800)  # FIGSIZE × DPI
    assert pixels[..., :3].std() > 0.05  # something is drawn, not a blank canvas
    svg = path.with_suffix(".svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "Date" not in svg


def test_result_plots_from_paper_rows(tmp_path, paper_results):
    report = plot_results(load_results(paper_results), tmp_path / "a")
    names = sorted(p.name for p in report.written)
    assert names == sorted(
        f"cv-en-ls100-seed-{kind}.{ext}"
        for kind in ("wer-vs-sigma", "privacy-utility", "wer-vs-cohort")
        for ext in ("png", "svg")
    )
    for path in report.written:
        if path.suffix == ".png":
            assert_image(path)
    again = plot_results(load_results(paper_results), tmp_path / "b")
    for first, second in zip(report.written, again.written, strict=True):
        assert first.read_bytes() == second.read_bytes(), f"{first.name} is not deterministic"


def test_missing_data_is_reported_not_drawn(tmp_path):
    records = [r for r in load_results(GOLDEN) if r.task.name == "fx-ls"]
    report = plot_results(records, tmp_path)
    assert report.written == []
    assert any("no DP results" in why for why in report.skipped)


def write_metrics(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(1, 7):
        norms = {f"layer{i}.weight": (i + 1) * 0.1 / step for i in range(6)}
        diagnostics = {
            "layer_norm_mean": norms,
            "layer_norm_std": {k: v / 10 for k, v in norms.items()},
            "clipped_fraction": 1.0,
            "private": False,
        }
        lines.append({"step": step, "loss": 3.0 / step, "lr": 0.002, "diagnostics": diagnostics})
        if step % 3 == 0:
            lines.append({"step": step, "eval": {"cv-dev": {"wer": 0.9 / step, "cer": 0.5}}})
    text = (
        "\n".join(json.dumps(line) for line in lines) + '\n{"step": 7, "loss'
    )  # cut off by a kill
    (run_dir / "metrics.jsonl").write_text(text)


def test_run_plots(tmp_path):
    run_dir = tmp_path / "my run"
    write_metrics(run_dir)
    report = plot_run(run_dir, tmp_path / "plots")
    assert sorted(p.name for p in report.written) == [
        "my_run-layer-norms.png",
        "my_run-layer-norms.svg",
        "my_run-training.png",
        "my_run-training.svg",
    ]
    for path in report.written[::2]:
        assert_image(path)
    assert report.skipped == [
        f"my_run: 1 unreadable line(s) in {run_dir / 'metrics.jsonl'} skipped"
    ]


def test_export_parquet(tmp_path):
    records = load_results(GOLDEN)
    rows = export_parquet(records, tmp_path / "results.parquet")
    table = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert rows == len(records) == len(table)
    by_id = {row["record_id"]: row for row in table}
    dp_row = next(row for row in table if row["budget"] == "fx-dp")
    assert dp_row["epsilon_extrapolated_rdp"] == 1.4225 and dp_row["sigma_dp"] == 0.01
    ls_row = next(row for row in table if row["task"] == "fx-ls")
    assert ls_row["wer.ls-test-other"] in (0.13, 0.16) and ls_row["wer.cv-test"] is None
    assert all(json.loads(row["record_json"])["record_id"] == rid for rid, row in by_id.items())


def test_cli_plot_and_export(tmp_path, paper_results):
    runner = CliRunner()
    result = runner.invoke(
        app, ["plot", "--results", str(paper_results), "--out", str(tmp_path), "--task", "nope"]
    )
    assert result.exit_code != 0 and "no records of this task" in str(result.exception)
    result = runner.invoke(
        app,
        [
            "results",
            "export",
            "--parquet",
            str(tmp_path / "r.parquet"),
            "--results",
            str(paper_results),
        ],
    )
    assert result.exit_code == 0 and pq.read_table(tmp_path / "r.parquet").num_rows == 16


# ----------------------------------------------------------------------------------------------
# Sweeps


def test_sweep_plan_and_skip_finished(tmp_path):
    plan = plan_sweep("fx-task", ["fedavg", "global"], ["fx-nodp"], [0, 1], [], tmp_path)
    assert [p.run_dir.name for p in plan] == [
        "fedavg__fx-nodp__seed0",
        "fedavg__fx-nodp__seed1",
        "global__fx-nodp__seed0",
        "global__fx-nodp__seed1",
    ]
    assert plan[0].command()[3:] == [
        "run",
        "--task",
        "fx-task",
        "--baseline",
        "fedavg",
        "--budget",
        "fx-nodp",
        "--seed",
        "0",
        "--out",
        str(plan[0].run_dir),
    ]
    # Finished runs (DONE) are not run again; their records are plotted.
    for run in plan:
        run.run_dir.mkdir(parents=True)
        source = next((GOLDEN / "fx-task" / "fx-nodp").glob("*.json"))
        (run.run_dir / "record.json").write_bytes(source.read_bytes())
        (run.run_dir / "DONE").write_text("")
    report = run_sweep(plan, tmp_path / "plots")
    assert len(report.skipped) == 4 and not report.finished and not report.failed


def test_a_run_begun_by_a_killed_sweep_is_resumed(tmp_path):
    (run,) = plan_sweep("fx-task", ["fedavg"], ["fx-nodp"], [0], [], tmp_path)
    assert run.command()[-2:] == ["--out", str(run.run_dir)]
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.json").write_text("{}")  # what `pflbench run` writes first
    assert run.started and run.command()[-2:] == ["--resume", str(run.run_dir)]
    (run.run_dir / "DONE").write_text("")
    assert run.done and not run.started


def test_sweep_reports_a_failing_run(tmp_path):
    # The real `pflbench run` fails fast without the real corpora; the sweep reports it.
    plan = plan_sweep(
        "cv-en-ls100-seed",
        ["perlayer-dim"],
        ["none"],
        [0],
        [],
        tmp_path,
        ("--data-root", str(tmp_path / "no-corpora"), "--no-progress"),
    )
    report = run_sweep(plan, tmp_path / "plots")
    assert [run for run, _ in report.failed] == plan and report.failed[0][1] != 0


def test_sweep_file_plans_groups_in_order_without_repeats(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(
        "task: fx-task\n"
        "groups:\n"
        "  - {baselines: [fedavg], seeds: [0, 1]}\n"
        "  - {baselines: [fedavg, global], budgets: [none], seeds: [1]}\n"
        "  - {baselines: [fedavg], set: [federated.cohort_size=8]}\n"
    )
    plan = plan_sweep_file(load_sweep_file(path), tmp_path / "runs")
    names = [run.run_dir.name for run in plan]
    assert names[:4] == [
        "fedavg__none__seed0",
        "fedavg__none__seed1",
        "global__none__seed1",
        names[3],
    ]
    assert len(names) == 4 and names[3].startswith("fedavg__none__seed0__")
    assert plan[3].sets == ("federated.cohort_size=8",)
    path.write_text("task: fx-task\ngroups:\n  - {baselines: [], seeds: [0]}\n")
    with pytest.raises(UserError, match="not a valid sweep file"):
        load_sweep_file(path)


def test_sweep_jobs_run_concurrently_with_a_share_of_the_threads(tmp_path, monkeypatch):
    # Two processes that record their OMP_NUM_THREADS and wait for each other: both exit 0 only
    # if the sweep runs them at the same time. (They write no record, so the sweep files them
    # as failed runs, with exit code 0.)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = (
        "import os, pathlib, sys, time\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "d.joinpath('threads').write_text(os.environ['OMP_NUM_THREADS'])\n"
        "t = time.time()\n"
        "while len(list(d.parent.glob('*/threads'))) < 2:\n"
        "    time.sleep(0.05)\n"
        "    if time.time() - t > 30: sys.exit(3)\n"
    )

    class ScriptRun(PlannedRun):
        def command(self) -> list[str]:
            return [sys.executable, "-c", script, str(self.run_dir)]

    plan = [
        ScriptRun("fx-task", name, "none", 0, (), tmp_path / "runs" / name) for name in ("a", "b")
    ]
    codes = []
    report = run_sweep(
        plan, tmp_path / "plots", jobs=2, on_done=lambda run, code: codes.append(code)
    )
    assert codes == [0, 0] and [code for _, code in report.failed] == [0, 0]
    cores = len(os.sched_getaffinity(0))
    assert {(run.run_dir / "threads").read_text() for run in plan} == {str(max(1, cores // 2))}


def test_sweep_dry_run_cli(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "sweep",
            "--task",
            "synth-cv-en-ls-seed",
            "--baselines",
            "perlayer-dim,global",
            "--budgets",
            "none,eps7.2-high-pop",
            "--seeds",
            "1,2",
            "--set",
            "federated.central_steps=3",
            "--out",
            str(tmp_path),
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 8 and all(line.startswith("to run") for line in lines)
    assert not any(tmp_path.iterdir())
