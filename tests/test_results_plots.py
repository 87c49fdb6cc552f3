"""Plots (non-empty images of the expected size, byte-identical reruns), Parquet export, sweeps."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot as plt
import pyarrow.parquet as pq
import pytest
from test_results_validity import matrix_being_filed
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.results.export import export_parquet
from pflbench.results.figures import MANIFEST, all_result_figures, first_of, stale_figures
from pflbench.results.groups import AGES, in_natural_order
from pflbench.results.leaderboard import Row, load_results
from pflbench.results.plots import draw, plot_results, plot_run
from pflbench.results.sweep import (
    PlannedRun,
    load_sweep_file,
    plan_sweep,
    plan_sweep_file,
    run_sweep,
)
from pflbench.results.validity import validity_reports
from pflbench.spec.registry import load_registry

REPO = Path(__file__).parents[1]
GOLDEN = Path(__file__).parent / "fixtures" / "results" / "golden" / "results"


@pytest.fixture
def paper_results(tmp_path) -> Path:
    """A results root holding only the repository's paper reference rows (not its run rows)."""
    root = tmp_path / "paper-results"
    shutil.copytree(REPO / "results" / "paper", root / "paper")
    return root


FEW_TASKS = ("cv-en-ls100-seed", "cv-en90-cv10-seed", "cv-fr90-cv10-seed")


@pytest.fixture
def few_paper_results(tmp_path) -> Path:
    """The repository's paper reference rows of three tasks (drawing all tasks' takes long)."""
    root = tmp_path / "few-paper-results"
    (root / "paper").mkdir(parents=True)
    for path in (REPO / "results" / "paper").glob("*.json"):
        if json.loads(path.read_text())["task"]["name"] in FEW_TASKS:
            shutil.copy(path, root / "paper" / path.name)
    return root


def assert_image(path: Path, size=(500, 800)) -> None:
    pixels = matplotlib.image.imread(path)
    if size is not None:
        assert pixels.shape[:2] == size
    assert pixels[..., :3].std() > 0.05  # something is drawn, not a blank canvas


@pytest.fixture(scope="module")
def specs():
    registry = load_registry()
    budgets = {name: loaded.spec for name, loaded in registry.budgets.items()}
    return budgets, {name: loaded.spec.budgets for name, loaded in registry.tasks.items()}


QUESTIONS = ("wer-vs-epsilon", "dp-cost-by-clipping", "wer-vs-cohort", "server-optimizers")


def test_result_figures_from_paper_rows(tmp_path, few_paper_results, specs):
    report = plot_results(load_results(few_paper_results), tmp_path / "a", None, *specs)
    names = {p.name for p in report.written}
    assert {f"cv-en-ls100-seed-{q}.png" for q in QUESTIONS[:3]} <= names
    assert "cv-en90-cv10-seed-server-optimizers.png" in names  # 002 Table 9
    assert "cv-fr90-cv10-seed-wer-vs-epsilon.png" in names  # 002 Table 18
    for path in report.written:
        assert_image(path, size=None)
    manifest = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert set(manifest) == {p.stem for p in report.written}
    again = plot_results(load_results(few_paper_results), tmp_path / "a", None, *specs)
    assert again.written == [] and again.removed == []  # nothing changed: nothing drawn


def _figures(records, specs):
    figures, skipped = all_result_figures(records, *specs)
    return {f.stem: f for f in figures}, skipped


def test_each_figure_answers_one_question_per_baseline(paper_results, specs):
    """Series are baselines (with a reference row's overrides), not clipping modes: no line
    joins rows of different baselines, and x increases along every line (no zig-zag)."""
    figures, _ = _figures(load_results(paper_results), specs)
    clipping = figures["cv-en-ls100-seed-dp-cost-by-clipping"].data["series"]
    assert [s["label"] for s in clipping] == ["global", "perlayer-dim", "perlayer-uniform"]
    for figure in figures.values():
        if figure.kind == "lines":
            for s in figure.data["series"]:
                xs = [p[0] for p in s["points"]]
                assert xs == sorted(set(xs)), (figure.stem, s["label"])
    levels = {s["label"]: s["level"] for s in clipping}  # the no-DP level of each baseline
    assert levels["global"][0] == pytest.approx(18.9) and levels["perlayer-dim"] is None
    epsilon = figures["cv-en-ls100-seed-wer-vs-epsilon"].data
    assert epsilon["categories"] == ["ε = 4.5", "ε = 7.2", "no DP"]
    cohort = {s["label"] for s in figures["cv-en-ls100-seed-wer-vs-cohort"].data["series"]}
    assert {"fedavg", "fedavg (10 local epochs)", "fedavg (T = 4000, 10 local epochs)"} <= cohort


def test_runs_with_per_speaker_counts_get_error_bars(specs):
    """The repository's embedded-task runs carry per-speaker counts: their points have CIs."""
    records = [r for r in load_results(REPO / "results") if r.kind == "run"]
    figures, _ = _figures(records, specs)
    points = [p for f in figures.values() if f.kind in ("lines", "categorical")
              for panel in (f.data.get("panels") or [f.data]) for s in panel["series"]
              for p in s["points"]]  # fmt: skip
    assert points and all(p[2] is not None and p[2] <= p[1] <= p[3] for p in points)


def test_styles_are_distinct_and_legends_lie_outside_the_data(tmp_path, paper_results, specs):
    records = load_results(paper_results) + [
        r for r in load_results(REPO / "results") if r.kind == "run"
    ]
    figures, _ = _figures(records, specs)
    for figure in figures.values():
        for panel in figure.data.get("panels") or [figure.data]:
            found = [tuple(s["style"]) for s in panel.get("series", []) if "style" in s]
            assert len(found) == len(set(found)), figure.stem
    for stem in (
        "synth-cv-en-ls-seed-wer-vs-epsilon",
        "cv-en-ls100-seed-wer-vs-cohort",
        "synth-cv-en-ls-seed-server-optimizers",
        "synth-cv-en-ls-seed-privacy-audit",
    ):
        fig = draw(figures[stem])  # fmt: skip
        fig.canvas.draw()
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + fig.legends
        assert legends, stem
        for legend in legends:
            box = legend.get_window_extent()
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent()), stem
        plt.close(fig)


def test_each_panel_fits_its_own_data_and_a_long_x_label_stays_in_the_figure(specs):
    """A diverged method in one panel (server-adagrad near 100% WER) must not stretch the other
    panels' y axes over its range; a long x label wraps inside the figure, clear of the legend."""
    records = [r for r in load_results(REPO / "results") if r.kind == "run"]
    figures, _ = _figures(records, specs)
    figure = figures["synth-cv-en-ls-seed-wer-vs-epsilon"]
    fig = draw(figure)
    for ax, panel in zip(fig.axes, figure.data["panels"], strict=True):
        points = [p for s in panel["series"] for p in s["points"]]
        low = min(p[2] if p[2] is not None else p[1] for p in points)
        high = max(p[3] if p[3] is not None else p[1] for p in points)
        bottom, top = ax.get_ylim()
        assert top - bottom <= 1.25 * (high - low), panel["title"]  # matplotlib's 5% margins
    plt.close(fig)

    single = figures["synth-cv-en-ls-seed-server-optimizers"]
    words = "where several server lrs ran, the one with the lowest dev WER, as Table 9 chose"
    long = dataclasses.replace(single, data={**single.data, "xlabel": f"{words}; {words}"})
    fig = draw(long)
    fig.canvas.draw()
    (ax,) = fig.axes
    label = ax.xaxis.label.get_window_extent()
    whole = fig.get_window_extent()
    assert whole.x0 <= label.x0 and label.x1 <= whole.x1 and whole.y0 <= label.y0
    assert "\n" in ax.get_xlabel()
    assert not ax.get_legend().get_window_extent().overlaps(label)
    plt.close(fig)


def test_group_figures_put_ages_youngest_first(specs):
    assert in_natural_order(["fifties", "fourties", "teens", "thirties", "twenties"]) == [
        "teens", "twenties", "thirties", "fourties", "fifties"]  # fmt: skip
    assert in_natural_order(["male", "female", "teens"]) == ["teens", "female", "male"]
    records = [r for r in load_results(REPO / "results") if r.kind == "run"]
    figures, _ = _figures(records, specs)
    ages = figures["synth-cv-en-ls-seed-group-wer"].data["attributes"]["age"]
    assert len(ages) >= 3 and ages == sorted(ages, key=AGES.index)


def test_the_group_figure_shows_the_anchors_and_the_default_budgets_methods(specs):
    """Of more rows than it can show, the per-group figure keeps the no-DP anchors and the
    methods under the task's default budget, not the rows whose names sort first."""
    task = "synth-cv-en-ls-seed"
    default = load_registry().tasks[task].spec.budgets[0]
    if matrix_being_filed():
        pytest.skip("the task's current version is still filing its matrix (sweeps/to-run/)")
    records = [r for r in load_results(REPO / "results") if r.kind == "run"]
    figures, _ = _figures(records, specs)
    labels = [s["label"] for s in figures[f"{task}-group-wer"].data["series"]]
    for anchor in ("seed-only", "fedavg", "central"):
        assert any(label.startswith(f"{anchor} / none") for label in labels), labels
    method = re.compile(rf"perlayer-dim( \(rule: clip\))? / {re.escape(default)} ")
    assert any(method.match(label) for label in labels), labels
    gaps = [s["label"] for s in figures[f"{task}-group-dp-gap"].data["series"]]
    assert gaps[0].split(" / ")[1].startswith(default), gaps


def test_the_server_optimizer_figure_draws_the_setting_validity_chose(specs):
    """Where the repository's embedded task ran a server optimizer at several lrs, the figure's
    point is the lr Table 9's validity report chose on cv-dev (the same runs, the same WER), not
    the baseline's lr nor the best test WER."""
    registry = load_registry()
    task = "synth-cv-en-ls-seed"
    records = load_results(REPO / "results")
    (table_9,) = validity_reports(
        records, task, specs[0], registry.tasks[task].spec.budgets,
        registry.tasks[task].spec.version, tables=["002 Table 9"])  # fmt: skip
    tuned = {c: settings for c, settings in table_9.tuning.items() if c[0].startswith("server-")}
    if matrix_being_filed():
        pytest.skip("the task's current version is still filing its matrix (sweeps/to-run/)")
    assert tuned, "no server optimizer of the embedded task was tuned on cv-dev"
    figures, _ = _figures([r for r in records if r.kind == "run"], specs)
    data = figures[f"{task}-server-optimizers"].data
    (panel,) = data["panels"]
    for (baseline, _, cohort), settings in tuned.items():
        chosen = settings[0]
        assert chosen.dev_wer == min(s.dev_wer for s in settings)
        column = data["categories"].index(f"no DP, S = {cohort}")
        (series,) = [s for s in panel["series"] if f"({baseline})" in s["label"]]
        (point,) = [p for p in series["points"] if p[0] == column]
        expected = 100 * table_9.embedded_wer[(baseline, "none", cohort)]
        assert point[1] == pytest.approx(expected, abs=1e-4), baseline
        assert point[4] == len(chosen.runs)


def test_missing_data_is_reported_not_drawn(tmp_path, specs):
    records = [r for r in load_results(GOLDEN) if r.task.name == "fx-ls"]
    report = plot_results(records, tmp_path, None, *specs)
    assert report.written == []
    assert any("no DP results" in why for why in report.skipped)


def test_stale_missing_and_extra_figures_are_found_without_drawing(
    tmp_path, few_paper_results, specs
):
    records = load_results(few_paper_results)
    folder = tmp_path / "figures"
    plot_results(records, folder, None, *specs)
    figures, _ = all_result_figures(records, *specs)
    assert stale_figures(figures, folder) == []
    changed = [r for r in records if r.record_id != next(
        r for r in records if r.task.name == "cv-fr90-cv10-seed" and r.budget != "none"
    ).record_id]  # fmt: skip
    now, _ = all_result_figures(changed, *specs)
    assert stale_figures(now, folder) == [  # a DP row of it is gone: both DP figures change
        f"cv-fr90-cv10-seed-{q}: drawn from other data than the records now give"
        for q in ("wer-vs-epsilon", "dp-cost-by-clipping")
    ]
    (folder / "cv-en-ls100-seed-wer-vs-cohort.png").unlink()
    (folder / "old-figure.png").write_bytes(b"")
    assert stale_figures(figures, folder) == [
        "cv-en-ls100-seed-wer-vs-cohort: missing",
        "old-figure: no longer a figure of the results",
    ]


def test_leaderboard_check_fails_on_a_missing_or_stale_figure(tmp_path, few_paper_results):
    runner = CliRunner()
    folder, board = tmp_path / "figures", tmp_path / "leaderboard.md"
    common = ["--results", str(few_paper_results)]
    assert runner.invoke(app, ["plot", *common, "--out", str(folder)]).exit_code == 0
    args = [*common, "--output", str(board), "--figures", str(folder)]
    assert runner.invoke(app, ["leaderboard", *args]).exit_code == 0
    assert (
        "![cv-en-ls100-seed: test WER vs cohort size](figures/cv-en-ls100-seed-wer-vs-cohort"
        ".png)" in board.read_text()
    )
    assert runner.invoke(app, ["leaderboard", "--check", *args]).exit_code == 0
    assert runner.invoke(app, ["plot", "--check", *common, "--out", str(folder)]).exit_code == 0
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["cv-en-ls100-seed-wer-vs-cohort"]["digest"] = "0" * 16
    (folder / MANIFEST).write_text(json.dumps(manifest))
    result = runner.invoke(app, ["leaderboard", "--check", *args])
    assert result.exit_code == 1 and "cv-en-ls100-seed-wer-vs-cohort: drawn from other" in (
        result.output
    )
    assert runner.invoke(app, ["plot", "--check", *common, "--out", str(folder)]).exit_code == 1
    result = runner.invoke(app, ["plot", *common, "--out", str(folder)])  # redraws just that one
    assert result.output.count("wrote") == 1
    assert runner.invoke(app, ["leaderboard", "--check", *args]).exit_code == 0


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
        svg = path.with_suffix(".svg").read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "Date" not in svg
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
    rows = len(list((paper_results / "paper").glob("*.json")))
    assert result.exit_code == 0 and pq.read_table(tmp_path / "r.parquet").num_rows == rows


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
        "  - {baselines: [fedavg], budgets: [none], seeds: [0, 1]}\n"
        "  - {baselines: [fedavg, global], budgets: [none], seeds: [1]}\n"
        "  - {baselines: [fedavg], budgets: [none], set: [federated.cohort_size=8]}\n"
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
    path.write_text("task: fx-task\ngroups:\n  - {baselines: [], budgets: [none]}\n")
    with pytest.raises(UserError, match="not a valid sweep file"):
        load_sweep_file(path)


def test_a_sweep_group_names_its_budgets(tmp_path):
    """A group without budgets is refused, naming the file and the key: `pflbench run` gives a
    clipping baseline the task's first budget where none is given, so a declared matrix could
    mean either that or no DP."""
    path = tmp_path / "grid.yaml"
    path.write_text("task: fx-task\ngroups:\n  - {baselines: [global], seeds: [0]}\n")
    with pytest.raises(
        UserError, match=r"grid.yaml: not a valid sweep file:\n  groups.0.budgets: required"
    ):
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


def _dry_run(tmp_path, *args: str):
    out = tmp_path / "runs"
    command = ["sweep", "--task", "synth-cv-en-ls-seed", *args, "--out", str(out), "--dry-run"]
    return CliRunner().invoke(app, command), out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--baselines", "global,fedavg", "--budgets", "eps7.2-synth-m-cohort-matched"],
            "sweep run fedavg at eps7.2-synth-m-cohort-matched: baseline 'fedavg' does not clip",
        ),
        (["--baselines", "perlayer-dim", "--budgets", "eps8-example"], "example-level"),
        (["--baselines", "fedavg", "--budgets", "none", "--set", "nosuch.key=1"], "nosuch"),
        (["--baselines", "fedavg", "--set", "federated.cohort_size"], "expected key.path=value"),
        (
            ["--baselines", "fedavg", "--budgets", "none", "--set", "federated.server.optimizer=x"],
            "unknown server optimizer 'x'",
        ),
    ],
)
def test_sweep_checks_every_run_as_pflbench_run_would_before_any_starts(tmp_path, args, message):
    # A sweep that `pflbench run` would refuse part of fails before its first run, with run's
    # message (a dry run included), instead of when the bad run's turn comes hours later.
    result, _ = _dry_run(tmp_path, *args)
    assert isinstance(result.exception, UserError), result.output  # `pflbench`: exit code 2
    assert message in str(result.exception)


def test_sweep_without_budgets_gives_each_baseline_the_budget_run_gives_it(tmp_path):
    result, out = _dry_run(tmp_path, "--baselines", "perlayer-dim,fedavg", "--seeds", "0,1")
    assert result.exit_code == 0, result.output
    budget = load_registry().task("synth-cv-en-ls-seed").spec.budgets[0]
    assert [line.split()[2] for line in result.stdout.splitlines()] == [
        str(out / "synth-cv-en-ls-seed" / name)
        for name in (
            f"perlayer-dim__{budget}__seed0",
            f"perlayer-dim__{budget}__seed1",
            "fedavg__none__seed0",
            "fedavg__none__seed1",
        )
    ]


def test_a_point_is_drawn_from_the_newest_row_not_a_stale_one_with_more_seeds():
    """Rows competing for one point: a stale row (older task version, or numerics) stands for it
    only where nothing newer ran, however many seeds it has; a figure cannot mark it stale."""
    records = [r for r in load_results(GOLDEN) if r.kind == "run"]
    old = next(r for r in records if r.baseline == "fedavg" and r.task.name == "fx-task")
    stale = Row(tuple(r for r in records if r.baseline == "fedavg" and r.task.name == "fx-task"))
    assert len(stale.records) == 3
    newer_task = old.model_copy(update={"task": old.task.model_copy(update={"version": 9})})
    assert first_of([stale, Row((newer_task,))]).first is newer_task
    newer_code = old.model_copy(
        update={"software": old.software.model_copy(update={"numerics_version": 99})}
    )
    assert first_of([stale, Row((newer_code,))]).first is newer_code
    assert len(first_of([Row((old,)), stale]).records) == 3  # same age: the most seeds
