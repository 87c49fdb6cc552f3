"""Figures from result records and run logs, as PNG and SVG, byte-identical for the same input.

Result figures (per task): WER vs σ_DP per clipping mode (paper Figs. 12-13), the privacy-utility
frontier (WER vs ε at the extrapolated scale), WER vs cohort size (Figs. 3-4), and audit ε vs the
accountant's ε at the simulated scale for privacy-audit runs (not in the WER figures), and
per-group WER and DP's cost per speaker group (results/groups.py). Run figures
(from a run's metrics.jsonl): per-layer client-delta norms (Fig. 6) and training curves.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from pflbench.results.groups import (  # noqa: E402
    dp_pairs,
    group_eval_set,
    is_ranked,
    row_label,
    rows_with_groups,
)
from pflbench.results.leaderboard import (  # noqa: E402
    Row,
    cohort_size,
    epsilon,
    group_rows,
    is_audit,
    is_dp,
)
from pflbench.results.schema import ResultRecord, safe_name  # noqa: E402

FIGSIZE = (8.0, 5.0)
DPI = 100  # → 800 × 500 px PNGs
STYLE = {
    "svg.hashsalt": "pflbench",  # fixed ids in SVG output
    "svg.fonttype": "path",
    "font.family": "DejaVu Sans",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.autolayout": False,
}


@dataclass
class PlotReport:
    written: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "figure: why"


def save(fig: plt.Figure, out_dir: Path, stem: str, report: PlotReport) -> None:
    """PNG + SVG without dates or software versions, so reruns are byte-identical."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png, svg = out_dir / f"{stem}.png", out_dir / f"{stem}.svg"
    fig.savefig(png, dpi=DPI, metadata={"Software": None})
    fig.savefig(svg, metadata={"Date": None, "Creator": None})
    plt.close(fig)
    report.written += [png, svg]


def new_figure(title: str, ncols: int = 1) -> tuple[plt.Figure, list[plt.Axes]]:
    fig, axes = plt.subplots(1, ncols, figsize=FIGSIZE, dpi=DPI, layout="constrained")
    fig.suptitle(title)
    return fig, list(axes) if ncols > 1 else [axes]


# ----------------------------------------------------------------------------------------------
# What a row contributes to the result figures


@dataclass(frozen=True)
class Point:
    series: str
    x: float
    wer_percent: float
    reference: bool


def test_sets(records: list[ResultRecord]) -> list[str]:
    return sorted({n for r in records for n, e in r.metrics.final.items() if e.role == "test"})


def clipping_mode(record: ResultRecord) -> str:
    privacy = ((record.config or {}).get("recipe") or {}).get("privacy")
    if privacy is None:  # a reference row: its baseline names the mode
        return record.baseline
    if privacy.get("clipping") == "perlayer":
        return f"perlayer-{privacy.get('perlayer_mode')}"
    return privacy.get("clipping", "none")


def points(rows: list[Row], sets: list[str], x_of, series_of) -> list[Point]:
    out = []
    for row in rows:
        x, wer = x_of(row.first), row.primary(sets)
        if x is None or wer is None or not math.isfinite(x) or x <= 0:
            continue
        out.append(Point(series_of(row.first), x, 100 * wer, row.first.kind == "reference"))
    return sorted(out, key=lambda p: (p.series, p.x, p.wer_percent))


def sigma_of(record: ResultRecord) -> float | None:
    privacy = record.privacy
    return privacy.sigma_dp if privacy is not None and privacy.dp else None


def epsilon_ext_of(record: ResultRecord) -> float | None:
    found = epsilon(record, "extrapolated")
    return found[0] if found else None


def draw_series(ax: plt.Axes, pts: list[Point]) -> None:
    """One line per series; paper rows as hollow markers, runs filled."""
    for i, series in enumerate(sorted({p.series for p in pts})):
        color = f"C{i % 10}"
        for reference, marker, fill in ((False, "o", color), (True, "s", "none")):
            sel = [p for p in pts if p.series == series and p.reference == reference]
            if sel:
                label = f"{series} (paper)" if reference else series
                ax.plot(
                    [p.x for p in sel],
                    [p.wer_percent for p in sel],
                    marker=marker,
                    color=color,
                    markerfacecolor=fill,
                    label=label,
                )


def pareto_front(pts: list[Point]) -> list[Point]:
    """Points no other point beats in both ε (lower) and WER (lower)."""
    front, best = [], math.inf
    for p in sorted(pts, key=lambda p: (p.x, p.wer_percent)):
        if p.wer_percent < best:
            front.append(p)
            best = p.wer_percent
    return front


# ----------------------------------------------------------------------------------------------
# Result figures


def plot_task(
    records: list[ResultRecord], task: str, out_dir: Path, report: PlotReport, budgets=None
) -> None:
    safe_name(task, "task name")
    records = [r for r in records if r.task.name == task]
    plot_audits([r for r in records if is_audit(r)], task, out_dir, report)
    records = [r for r in records if not is_audit(r)]  # their models carry canaries
    rows, sets = group_rows(records), test_sets(records)
    ylabel = "test WER (%)"
    plot_groups(rows, task, lambda b: is_dp(b, budgets or {}), out_dir, report)

    pts = points(rows, sets, sigma_of, clipping_mode)
    if pts:
        fig, (ax,) = new_figure(f"{task}: WER vs DP noise per clipping mode")
        draw_series(ax, pts)
        ax.set(xscale="log", xlabel="σ_DP (noise std of the averaged update / C)", ylabel=ylabel)
        ax.legend(fontsize="small")
        save(fig, out_dir, f"{task}-wer-vs-sigma", report)
    else:
        report.skipped.append(f"{task}-wer-vs-sigma: no DP results")

    pts = points(rows, sets, epsilon_ext_of, lambda r: r.baseline)
    if pts:
        fig, (ax,) = new_figure(f"{task}: privacy-utility frontier")
        draw_series(ax, pts)
        front = pareto_front(pts)
        ax.step(
            [p.x for p in front],
            [p.wer_percent for p in front],
            where="post",
            color="black",
            linestyle=":",
            label="frontier",
        )
        ax.set(xscale="log", xlabel="ε at the extrapolated scale", ylabel=ylabel)
        ax.legend(fontsize="small")
        save(fig, out_dir, f"{task}-privacy-utility", report)
    else:
        report.skipped.append(f"{task}-privacy-utility: no results with a finite ε")

    pts = points(rows, sets, cohort_size, lambda r: f"{r.baseline} / {r.budget}")
    # Only series run at several cohort sizes say anything about the cohort (a full matrix
    # has dozens of single-size rows, whose legend would bury the axes).
    sizes: dict[str, set[float]] = {}
    for p in pts:
        sizes.setdefault(p.series, set()).add(p.x)
    pts = [p for p in pts if len(sizes[p.series]) > 1]
    if pts:
        fig, (ax,) = new_figure(f"{task}: WER vs cohort size")
        draw_series(ax, pts)
        ax.set(xscale="log", xlabel="cohort size S", ylabel=ylabel)
        ax.legend(fontsize="small")
        ax.set_xticks(sorted({p.x for p in pts}))  # ticks at the cohorts run, in plain numbers
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        save(fig, out_dir, f"{task}-wer-vs-cohort", report)
    else:
        report.skipped.append(f"{task}-wer-vs-cohort: no row run at two cohort sizes")


MAX_GROUP_SERIES = 8  # more dot series than this cannot be told apart


def plot_groups(rows: list[Row], task: str, is_dp, out_dir: Path, report: PlotReport) -> None:
    """Per-group WER (each attribute a panel, each ranked group a column, each row a series)
    and DP's cost per group (group WER under the budget minus the no-DP partner's)."""
    eval_set = group_eval_set([r for row in rows for r in row.records])
    if eval_set is None:
        report.skipped.append(f"{task}-group-wer: no records with per-group WER")
        return
    found = rows_with_groups(rows, eval_set)
    gaps = [
        (row, {a: {n: v.wer - base[a][n].wer for n, v in by_name.items() if n in base.get(a, {})}
               for a, by_name in groups.items()})
        for row, groups, base in dp_pairs(found, is_dp)
    ]  # fmt: skip
    wers = [(row, {a: {n: v.wer for n, v in by_name.items()} for a, by_name in g.items()})
            for row, g in found]  # fmt: skip
    ranked: dict[str, set[str]] = {}
    for _, groups in found:
        for a, by_name in groups.items():
            ranked.setdefault(a, set()).update(n for n, v in by_name.items() if is_ranked(n, v))
    ranked = {a: sorted(names) for a, names in ranked.items()}
    for stem, series, ylabel in (
        (f"{task}-group-wer", wers, f"{eval_set} WER (%) of the group"),
        (f"{task}-group-dp-gap", gaps, "WER under DP − WER without DP (points)"),
    ):
        if not series:
            report.skipped.append(f"{stem}: no rows to draw")
            continue
        series = sorted(series, key=lambda t: (-len(t[0].records), t[0].first.baseline,
                                               t[0].first.budget))[:MAX_GROUP_SERIES]  # fmt: skip
        attributes = [a for a in sorted(ranked) if ranked[a]]
        fig, axes = new_figure(
            f"{task}: {ylabel.split(' (')[0]} per speaker group", len(attributes)
        )
        for ax, attribute in zip(axes, attributes, strict=True):
            names = ranked[attribute]
            for i, (row, values) in enumerate(series):
                ys = [100 * values.get(attribute, {}).get(n, math.nan) for n in names]
                label = f"{row_label(row.first)} / {row.first.budget} (n={len(row.records)})"
                ax.plot(range(len(names)), ys, marker="o", color=f"C{i}", alpha=0.8, label=label)
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize="small")
            ax.set(title=attribute, ylabel=ylabel if ax is axes[0] else None)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="x-small")
        save(fig, out_dir, stem, report)


def plot_audits(records: list[ResultRecord], task: str, out_dir: Path, report: PlotReport) -> None:
    """Audit ε (estimate, and lower bound below it) against the accountant's ε at the simulated
    scale, one series per baseline / budget; the diagonal is where the audit would meet it."""
    stem = f"{task}-privacy-audit"
    if not records:
        report.skipped.append(f"{stem}: no privacy-audit runs")
        return
    drawn = []
    for record in records:
        found = epsilon(record, "simulated")
        if found is None or not math.isfinite(found[0]):
            report.skipped.append(f"{stem}: {record.record_id} has no finite accountant ε")
            continue
        drawn.append((f"{record.baseline} / {record.budget}", found[0], record.privacy.audit))
    if not drawn:
        return
    fig, (ax,) = new_figure(f"{task}: empirical privacy audit vs accountant")
    for i, series in enumerate(sorted({d[0] for d in drawn})):
        pts = sorted(
            (x, a.epsilon_estimate, a.epsilon_lower_bound) for s, x, a in drawn if s == series
        )
        xs = [p[0] for p in pts]
        ax.scatter(xs, [p[1] for p in pts], color=f"C{i}", marker="o", label=f"{series}: estimate")
        ax.scatter(xs, [p[2] for p in pts], color=f"C{i}", marker="v", facecolor="none",
                   label=f"{series}: lower bound")  # fmt: skip
        ax.vlines(xs, [p[2] for p in pts], [p[1] for p in pts], color=f"C{i}", alpha=0.5)
    low = min(min(x, a.epsilon_lower_bound or x) for _, x, a in drawn)
    high = max(max(x, a.epsilon_estimate) for _, x, a in drawn)
    ax.plot([low, high], [low, high], color="black", linestyle=":", label="audit = accountant")
    ax.set_yscale("symlog", linthresh=1.0)  # a lower bound of 0 stays on the axis
    ax.set(xscale="log", ylim=(0, 2 * high), xlabel="accountant ε at the simulated scale")
    ax.set(ylabel="audit ε (one run, canaries)")
    ax.legend(fontsize="small")
    save(fig, out_dir, stem, report)


def plot_results(
    records: list[ResultRecord], out_dir: Path, task: str | None = None, budgets=None
) -> PlotReport:
    """budgets: name -> Budget, to tell DP budgets from no-DP ones (else: "none" is no DP)."""
    report = PlotReport()
    with plt.rc_context(STYLE):
        for name in sorted({r.task.name for r in records} if task is None else {task}):
            plot_task(records, name, Path(out_dir), report, budgets)
    return report


# ----------------------------------------------------------------------------------------------
# Run figures (metrics.jsonl)


@dataclass
class RunLog:
    steps: list[dict]  # training lines: {"step", "loss", "diagnostics", ...}
    evals: list[dict]  # eval lines: {"step", "eval": {set: {wer, cer}}}
    bad_lines: int


def read_metrics(path: Path) -> RunLog:
    """metrics.jsonl; a line that is not a JSON object (cut off by a kill) is counted, skipped."""
    log = RunLog([], [], 0)
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            try:
                item = json.loads(line)
            except ValueError:
                item = None
            if not isinstance(item, dict) or not isinstance(item.get("step"), int):
                log.bad_lines += 1
            elif "eval" in item:
                log.evals.append(item)
            else:
                log.steps.append(item)
    return log


def plot_layer_norms(log: RunLog, title: str, out_dir: Path, report: PlotReport) -> None:
    with_norms = [s for s in log.steps if (s.get("diagnostics") or {}).get("layer_norm_mean")]
    if not with_norms:
        report.skipped.append(f"{title}-layer-norms: no per-layer diagnostics in metrics.jsonl")
        return
    picks = sorted({0, len(with_norms) // 2, len(with_norms) - 1})
    fig, (ax,) = new_figure(f"{title}: client-delta norm per layer (before clipping)")
    for i, line in enumerate(with_norms[p] for p in picks):
        means = line["diagnostics"]["layer_norm_mean"]
        stds = line["diagnostics"].get("layer_norm_std") or {}
        names = list(means)
        mean = [means[n] for n in names]
        std = [stds.get(n, 0.0) for n in names]
        x = range(len(names))
        ax.plot(x, mean, color=f"C{i}", label=f"step {line['step']}")
        low = [max(m - s, 1e-12) for m, s in zip(mean, std, strict=True)]
        ax.fill_between(
            x, low, [m + s for m, s in zip(mean, std, strict=True)], color=f"C{i}", alpha=0.2
        )
    ax.set(
        yscale="log",
        xlabel="layer (parameter tensor, model order)",
        ylabel="‖Δ_h‖ mean ± std over clients",
    )
    ax.legend(fontsize="small")
    save(fig, out_dir, f"{title}-layer-norms", report)


def plot_training_curves(log: RunLog, title: str, out_dir: Path, report: PlotReport) -> None:
    losses = [(s["step"], s["loss"]) for s in log.steps if isinstance(s.get("loss"), int | float)]
    if not losses and not log.evals:
        report.skipped.append(f"{title}-training: no loss or eval lines in metrics.jsonl")
        return
    fig, (ax_loss, ax_wer) = new_figure(f"{title}: training curves", ncols=2)
    if losses:
        ax_loss.plot(*zip(*losses, strict=True), color="C0")
    ax_loss.set(xlabel="central step", ylabel="training loss")
    sets = sorted({name for e in log.evals for name in e["eval"]})
    for i, name in enumerate(sets):
        curve = [(e["step"], 100 * e["eval"][name]["wer"]) for e in log.evals if name in e["eval"]]
        ax_wer.plot(*zip(*curve, strict=True), marker="o", color=f"C{i}", label=name)
    ax_wer.set(xlabel="central step", ylabel="WER (%)")
    if sets:
        ax_wer.legend(fontsize="small")
    save(fig, out_dir, f"{title}-training", report)


def run_title(run_dir: Path) -> str:
    """A file-name-safe stem from the run folder's name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(run_dir).resolve().name).strip("._") or "run"


def plot_run(run_dir: Path, out_dir: Path, report: PlotReport | None = None) -> PlotReport:
    report = report or PlotReport()
    path = Path(run_dir) / "metrics.jsonl"
    title = run_title(run_dir)
    if not path.is_file():
        report.skipped.append(f"{title}: no metrics.jsonl in {run_dir}")
        return report
    log = read_metrics(path)
    if log.bad_lines:
        report.skipped.append(f"{title}: {log.bad_lines} unreadable line(s) in {path} skipped")
    with plt.rc_context(STYLE):
        plot_layer_norms(log, title, Path(out_dir), report)
        plot_training_curves(log, title, Path(out_dir), report)
    return report
