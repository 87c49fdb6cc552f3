"""Drawing figures: the result figures results/figures.py computes, and run-log figures.

Result figures are PNGs in a folder with a manifest of the digests of the data each was drawn
from (results/figures.py); `write_figures` draws only the ones whose data changed.

Run figures (from a run's metrics.jsonl, PNG and SVG, byte-identical for the same input):
per-layer client-delta norms (Fig. 6) and training curves.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from pflbench.files import atomic_write_text  # noqa: E402
from pflbench.results.figures import (  # noqa: E402
    MANIFEST,
    MARKERS,
    PALETTE,
    Figure,
    all_result_figures,
    read_manifest,
)
from pflbench.results.schema import ResultRecord  # noqa: E402
from pflbench.spec.models import Budget  # noqa: E402

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
    removed: list[Path] = field(default_factory=list)


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
# Drawing


def draw(figure: Figure) -> plt.Figure:
    with plt.rc_context(STYLE):
        fig = DRAWERS[figure.kind](figure)
        fig.suptitle(figure.title)
        return fig


def _errorbar(ax, xs, pts, style, label, linestyle) -> None:
    """Points [x, y, low, high, seeds] as markers (joined by `linestyle`), each CI as a capped
    bar from low to high (drawn as given: a CI need not be centred on the mean)."""
    ax.plot(xs, [p[1] for p in pts], color=style[0], marker=style[1], markersize=7,
            linestyle=linestyle, label=label)  # fmt: skip
    bars = [(x, p[2], p[3]) for x, p in zip(xs, pts, strict=True) if p[2] is not None]
    if bars:
        bx, low, high = zip(*bars, strict=True)
        ax.vlines(bx, low, high, color=style[0], linewidth=1.2)
        ax.plot(bx * 2, low + high, linestyle="none", marker="_", markersize=8, color=style[0])


def draw_categorical(figure: Figure) -> plt.Figure:
    """Categories on x (budgets, or budget × cohort groups), series side by side within each."""
    data = figure.data
    panels, categories = data["panels"], data["categories"]
    ratios = [max(len(p["series"]), 3) * max(len(categories), 2) for p in panels]
    width = min(2.0 + 0.55 * sum(ratios), 17.0)
    # Each panel its own y range: one diverged method (a server optimizer near 100% WER) would
    # otherwise squeeze another panel's few-point differences, the ones its question is about.
    fig, axes = plt.subplots(
        1, len(panels), figsize=(width, 6.5), dpi=DPI,
        layout="constrained", squeeze=False, width_ratios=ratios,
    )  # fmt: skip
    xlabel = _wrapped(data["xlabel"], width)
    # A one-panel figure's x label lies between the axes and the legend: each extra line of it
    # moves the legend down (about 0.05 of the axes' height), so the two do not overlap.
    below = 0.1 + (0.05 * xlabel.count("\n") if len(panels) == 1 else 0.0)
    for ax, panel in zip(axes[0], panels, strict=True):
        series = panel["series"]
        for i, s in enumerate(series):
            offset = min(0.7, 0.15 * len(series)) * ((i + 0.5) / len(series) - 0.5)
            xs = [p[0] + offset for p in s["points"]]
            _errorbar(ax, xs, s["points"], s["style"], s["label"],
                      "-" if data["connect"] else "none")  # fmt: skip
        ax.set_xticks(range(len(categories)), categories, fontsize="small")
        ax.set_xlim(-0.6, len(categories) - 0.4)
        ax.set(title=panel["title"] if len(panels) > 1 else None)
        ax.set(xlabel=xlabel if len(panels) == 1 else None)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -below), ncols=2, fontsize="small",
                  frameon=False, title=_ci_title(panels) if ax is axes[0][0] else None,
                  title_fontsize="x-small")  # fmt: skip
    axes[0][0].set_ylabel(data["ylabel"])
    if len(panels) > 1:
        fig.supxlabel(xlabel, fontsize="medium")
    return fig


def _wrapped(label: str, width_inches: float) -> str:
    """`label` in lines that fit a figure `width_inches` wide (medium font: ~11 characters an
    inch), so that a long axis label is not cut off at the figure's edges."""
    return "\n".join(textwrap.wrap(label, max(20, int(width_inches * 11))))


def draw_lines(figure: Figure) -> plt.Figure:
    """x numeric on a log axis, one line per series; a series' `level` (its value without DP)
    as a dashed line in its colour. Points at one x are spread a little to keep error bars apart."""
    data = figure.data
    series = data["series"]
    fig, ax = plt.subplots(figsize=(10.0, 5.5), dpi=DPI, layout="constrained")
    with_ci = _ci_title([data]) is not None  # spread points only to keep error bars apart
    for i, s in enumerate(series):
        spread = 1.0 + 0.16 * ((i + 0.5) / len(series) - 0.5) * with_ci
        _errorbar(ax, [p[0] * spread for p in s["points"]], s["points"], s["style"], s["label"],
                  "-")  # fmt: skip
        if s.get("level"):
            ax.axhline(s["level"][0], color=s["style"][0], linestyle="--", linewidth=1.2)
    ax.set(xscale="log", xlabel=data["xlabel"], ylabel=data["ylabel"])
    if data["xticks"]:
        ax.set_xticks(data["xticks"])  # at the values run, in plain numbers
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if len(data["xticks"]) > 8:  # close on a log axis: slanted, so they do not overlap
            ax.tick_params(axis="x", labelrotation=45)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False,
              title=_ci_title([data]), title_fontsize="x-small", alignment="left")  # fmt: skip
    return fig


def _ci_title(panels: list[dict]) -> str | None:
    """The legend's note on error bars, where any point has a CI."""
    if any(p[2] is not None for panel in panels for s in panel["series"] for p in s["points"]):
        return (
            "error bars: 95% CI over speakers\nand seeds (paired differences are\n"
            "tighter: pflbench compare)"
        )
    return None


def draw_groups(figure: Figure) -> plt.Figure:
    data = figure.data
    attributes = data["attributes"]
    fig, axes = plt.subplots(1, len(attributes), figsize=(12.0, 6.0), dpi=DPI,
                             layout="constrained", squeeze=False)  # fmt: skip
    for ax, (attribute, names) in zip(axes[0], attributes.items(), strict=True):
        for i, s in enumerate(data["series"]):
            ys = [math.nan if v is None else v for v in s["values"][attribute]]
            ax.plot(range(len(names)), ys, marker=MARKERS[i % len(MARKERS)], color=PALETTE[i],
                    alpha=0.85, label=s["label"])  # fmt: skip
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize="small")
        ax.set(title=attribute, ylabel=data["ylabel"] if ax is axes[0][0] else None)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="small",
               frameon=False)  # fmt: skip
    return fig


def draw_audit(figure: Figure) -> plt.Figure:
    points = figure.data["points"]
    fig, ax = plt.subplots(figsize=(9.0, 5.5), dpi=DPI, layout="constrained")
    for i, series in enumerate(sorted({p[0] for p in points})):
        pts = sorted(p[1:] for p in points if p[0] == series)
        xs = [p[0] for p in pts]
        ax.scatter(xs, [p[1] for p in pts], color=PALETTE[i], marker="o",
                   label=f"{series}: estimate")  # fmt: skip
        ax.scatter(xs, [p[2] for p in pts], color=PALETTE[i], marker="v", facecolor="none",
                   label=f"{series}: lower bound")  # fmt: skip
        ax.vlines(xs, [p[2] for p in pts], [p[1] for p in pts], color=PALETTE[i], alpha=0.5)
    low = min(min(p[1], p[3] or p[1]) for p in points)
    high = max(max(p[1], p[2]) for p in points)
    ax.plot([low, high], [low, high], color="black", linestyle=":", label="audit = accountant")
    ax.set_yscale("symlog", linthresh=1.0)  # a lower bound of 0 stays on the axis
    ax.set(xscale="log", ylim=(0, 2 * high), xlabel="accountant ε at the simulated scale")
    ax.set(ylabel="audit ε (one run, canaries)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


DRAWERS = {
    "categorical": draw_categorical,
    "lines": draw_lines,
    "groups": draw_groups,
    "audit": draw_audit,
}


def write_figures(
    figures: list[Figure], folder: Path, report: PlotReport, only_task: str | None = None
) -> None:
    """Draw the figures whose PNG is missing or whose data changed, delete the ones the manifest
    lists that are no longer figures (of `only_task`, when given), and rewrite the manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(folder)
    kept = {
        stem: entry
        for stem, entry in manifest.items()
        if only_task is not None and (entry or {}).get("task") != only_task
    }
    wanted = {f.stem for f in figures}
    for stem in sorted(set(manifest) - wanted - set(kept)):
        (folder / f"{stem}.png").unlink(missing_ok=True)
        report.removed.append(folder / f"{stem}.png")
    for f in figures:
        png = folder / f"{f.stem}.png"
        if png.is_file() and (manifest.get(f.stem) or {}).get("digest") == f.digest:
            continue
        fig = draw(f)
        fig.savefig(png, dpi=DPI, metadata={"Software": None})
        plt.close(fig)
        report.written.append(png)
    entries = {f.stem: {"task": f.task, "title": f.title, "digest": f.digest} for f in figures}
    text = json.dumps({**kept, **entries}, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_text(folder / MANIFEST, text)


def plot_results(
    records: list[ResultRecord],
    out_dir: Path,
    task: str | None = None,
    budgets: dict[str, Budget] | None = None,
    declared: dict[str, list[str]] | None = None,
) -> PlotReport:
    """Every task's result figures (or one task's) as PNGs in out_dir with their manifest.
    budgets: name -> Budget (ε of each budget; which are DP); declared: task -> its budgets."""
    figures, skipped = all_result_figures(records, budgets or {}, declared or {}, task)
    report = PlotReport(skipped=skipped)
    write_figures(figures, out_dir, report, only_task=task)
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
