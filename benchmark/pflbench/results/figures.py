"""Result figures as data: what each figure shows, computed from records, and its digest.

One figure per question, per task: test WER at each privacy budget per method (with the no-DP
level), DP's cost per clipping mode (WER vs σ_DP, paper 002 Figs. 12-13), WER vs cohort size
(Figs. 3-4), server optimizers side by side (Tables 8-9); then per-group WER and DP's cost per
speaker group (results/groups.py), and audit ε vs the accountant's ε for privacy-audit runs (which
the WER figures leave out). Series are baselines (with a reference row's --set overrides), each
with its own colour and marker within a panel; error bars are 95% CIs where the records carry
per-speaker counts (results/stats.py).

A figure's digest hashes its data; the figures folder keeps a manifest of the digests it was
drawn from, so a missing or stale figure is found without matplotlib (`pflbench plot --check`,
`pflbench leaderboard --check`). results/plots.py draws them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pflbench.errors import UserError
from pflbench.results.groups import (
    dp_pairs,
    group_eval_set,
    in_natural_order,
    is_ranked,
    row_label,
    rows_with_groups,
)
from pflbench.results.leaderboard import Row, cohort_size, epsilon, group_rows, is_audit, is_dp
from pflbench.results.schema import ResultRecord, record_numerics_version
from pflbench.results.stats import row_interval
from pflbench.results.validity import COHORT_KEY, SERVER_LR_KEY, dev_wer
from pflbench.spec.models import Budget
from pflbench.spec.names import safe_name
from pflbench.spec.resolve import canonical_json, set_values

FIGURES_VERSION = 2  # bump when the drawing changes, so that every figure is drawn again
MANIFEST = "figures.json"  # in the figures folder: figure -> task, title, digest
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
PALETTE = (  # matplotlib's tab10
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
NO_DP = "no DP"
FAMILIES = (  # panels of the WER-vs-ε figure, by baseline name
    ("clipping", ("global", "perlayer-", "adaptive-")),
    ("server optimizer", ("server-",)),
    ("client-side method", ("fedprox", "data-limit", "fvn", "layerfreeze", "scaffold")),
    ("privacy mechanism", ("bandmf-",)),
)
FAMILY_ORDER = (*(name for name, _ in FAMILIES), "other")  # family()'s names, in panel order
OPTIMIZERS = {"lamb": "LAMB", "lars": "LARS", "adam": "Adam", "adagrad": "AdaGrad", "sgd": "SGD"}


@dataclass(frozen=True)
class Figure:
    """One result figure: its file stem, task, title, kind (which drawer) and data (JSON)."""

    stem: str
    task: str
    title: str
    kind: str
    data: dict

    @property
    def digest(self) -> str:
        body = {"version": FIGURES_VERSION, "stem": self.stem, "title": self.title}
        body.update(kind=self.kind, data=self.data)
        return hashlib.sha256(canonical_json(body).encode()).hexdigest()[:16]


def family(baseline: str) -> str:
    for name, prefixes in FAMILIES:
        if baseline.startswith(prefixes):
            return name
    return "other"


def overrides_of(record: ResultRecord) -> dict[str, str]:
    """The --set overrides of a run, or the ones a reference row's configuration needs."""
    if record.provenance is not None:
        return dict(record.provenance.overrides)
    return set_values(record.config or {})


PHRASES = {  # --set key -> how a figure's legend says it
    "federated.client.local_epochs": "{} local epochs",
    "federated.central_steps": "T = {}",
    "privacy.clip_bound": "C = {}",
    "federated.client.fedprox_mu": "μ = {}",
    "federated.server.lr": "server lr {}",
    "model.layer_drop": "layer drop {}",
    "central.steps": "seed after {} steps",
}
NEGATIONS = {"spec_augment.enabled": "no SpecAugment", "privacy.clipping": "no clipping"}


def describe_overrides(overrides: dict[str, str], skip=(COHORT_KEY,)) -> str:
    items = {k: v for k, v in sorted(overrides.items()) if k not in skip}
    if "federated.client.local_epochs" in items:
        items.pop("federated.client.local_steps", None)  # set to null alongside
    out = []
    for key, value in items.items():
        if key in NEGATIONS and value in ("false", "none"):
            out.append(NEGATIONS[key])
        elif key in PHRASES:
            out.append(PHRASES[key].format(value))
        else:
            out.append(f"{key.rsplit('.', 1)[-1]}={value}")
    return ", ".join(out)


def series_label(record: ResultRecord, skip=(COHORT_KEY,)) -> str:
    described = describe_overrides(overrides_of(record), skip)
    return record.baseline + (f" ({described})" if described else "")


@dataclass(frozen=True)
class Measured:
    """A row's test WER (%) with its 95% CI (None without per-speaker counts) and seeds."""

    wer: float
    low: float | None
    high: float | None
    seeds: int

    def json(self) -> list:
        return [round(self.wer, 6), _round(self.low), _round(self.high), self.seeds]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def wer_label(sets: list[str]) -> str:
    return "test WER (%)" + (f", mean of {' and '.join(sets)}" if len(sets) > 1 else "")


def measure(row: Row, sets: list[str]) -> Measured | None:
    wer = row.primary(sets)
    if wer is None:
        return None
    interval = row_interval(row.records, sets[0]) if len(sets) == 1 else None
    if interval is None:
        return Measured(100 * wer, None, None, len(row.records))
    return Measured(100 * wer, 100 * interval.low, 100 * interval.high, len(row.records))


def first_of(rows: list[Row]) -> Row:
    """Of rows competing for one point: the newest (task version, then numerics: a stale row
    stands for a point only where nothing newer ran, and a figure cannot mark it), then the one
    with the fewest overrides, then most seeds."""

    def order(row: Row) -> tuple:
        record = row.first
        numerics = record_numerics_version(record) if record.software else 0  # 0: a paper's row
        newest = (-record.task.version, -numerics)
        return (*newest, len(overrides_of(record)), -len(row.records), record.record_id)

    return min(rows, key=order)


def tuned_first(rows: list[Row]) -> Row:
    """Of rows of one optimizer at one budget and cohort, differing in the server lr: the one
    with the lowest dev WER (validity.dev_wer, the rule Table 9's validity chooses by), else
    first_of's."""
    scored = [(wer, row) for row in rows if (wer := dev_wer(row.records)) is not None]
    if len(scored) < 2:
        return first_of(rows)
    return min(scored, key=lambda t: (t[0], t[1].first.record_id))[1]


def dp_of(row: Row, budgets: dict[str, Budget]) -> bool:
    return is_dp(row.first.budget, budgets)


def styles(labels) -> dict[str, list]:
    """[colour, marker] per series label, in sorted order (the same labels get the same styles
    in every figure)."""
    return {
        label: [PALETTE[i % len(PALETTE)], MARKERS[(i + i // 10) % len(MARKERS)]]
        for i, label in enumerate(sorted(set(labels)))
    }


def task_budget_names(task: str, budgets: dict[str, Budget], declared: dict) -> list[str]:
    """The DP budgets a task's runs are compared under: the ones it declares, else the paper's
    (registry user-level DP budgets not matched to another)."""
    names = declared.get(task) or [
        n
        for n, b in budgets.items()
        if b.dp and b.unit == "user" and b.matches is None and n != "none"
    ]
    return sorted((n for n in names if n in budgets), key=lambda n: (budgets[n].epsilon, n))


def epsilon_figure(rows, task, sets, budgets, declared) -> Figure | str:
    dp_names = task_budget_names(task, budgets, declared)
    points: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        name = row.first.budget
        if overrides_of(row.first) or (name not in dp_names and dp_of(row, budgets)):
            continue
        slot = dp_names.index(name) if name in dp_names else len(dp_names)
        points.setdefault((row.first.baseline, slot), []).append(row)
    with_dp = sorted({b for b, slot in points if slot < len(dp_names)})
    if not with_dp:
        return f"{task}-wer-vs-epsilon: no results under the task's DP budgets"
    epsilons = [budgets[n].epsilon for n in dp_names]  # of the budgets, not a row's own claim
    categories = [
        f"ε = {e:g}" + (f"\n{n}" if epsilons.count(e) > 1 else "")
        for e, n in zip(epsilons, dp_names, strict=True)
    ] + [NO_DP]
    panels = []
    for name, _ in (*FAMILIES, ("other", ())):
        members = [b for b in with_dp if family(b) == name]
        series = []
        for baseline in members:
            found = [(slot, measure(first_of(points[(baseline, slot)]), sets))
                     for slot in range(len(categories)) if (baseline, slot) in points]  # fmt: skip
            series.append({"label": baseline, "points": [[s, *m.json()] for s, m in found if m]})
        if series:
            panels.append({"title": name, "series": series})
    return Figure(
        f"{task}-wer-vs-epsilon",
        task,
        f"{task}: test WER at each privacy budget, by method",
        "categorical",
        {
            "categories": categories,
            "xlabel": f"privacy budget ({', '.join(dp_names)}): ε at its extrapolated scale",
            "ylabel": wer_label(sets),
            "connect": True,
            "panels": panels,
        },
    )


def clipping_figure(rows, task, sets, budgets) -> Figure | str:
    dp_rows: dict[str, list[tuple[float, Row]]] = {}
    levels: dict[str, list[Row]] = {}
    for row in rows:
        record = row.first
        if family(record.baseline) != "clipping" or overrides_of(record):
            continue
        if dp_of(row, budgets):
            sigma = record.privacy.sigma_dp if record.privacy else None
            if sigma:
                dp_rows.setdefault(record.baseline, []).append((sigma, row))
        else:
            levels.setdefault(record.baseline, []).append(row)
    if not dp_rows:
        return f"{task}-dp-cost-by-clipping: no DP results of clipping baselines"
    series = []
    for baseline in sorted(dp_rows):
        by_sigma: dict[float, list[Row]] = {}
        for sigma, row in dp_rows[baseline]:
            by_sigma.setdefault(sigma, []).append(row)
        measured = [(s, measure(first_of(by_sigma[s]), sets)) for s in sorted(by_sigma)]
        pts = [[s, *m.json()] for s, m in measured if m]
        level = measure(first_of(levels[baseline]), sets) if baseline in levels else None
        series.append({"label": baseline, "points": pts, "level": level.json() if level else None})
    return Figure(
        f"{task}-dp-cost-by-clipping",
        task,
        f"{task}: DP's cost per clipping mode (dashed: the same baseline without DP)",
        "lines",
        {
            "xlabel": "σ_DP: noise std on the averaged update, relative to the clip bound C",
            "ylabel": wer_label(sets),
            "xticks": None,
            "series": series,
        },
    )


def cohort_figure(rows, task, sets, budgets) -> Figure | str:
    """One line per configuration but the cohort size. Where two papers' tables print one
    configuration with different WERs, each table's rows are a line of their own."""
    by_series: dict[tuple[str, str], dict[int, list[Row]]] = {}
    for row in rows:
        size = cohort_size(row.first)
        if size is None:
            continue
        label = series_label(row.first)
        if dp_of(row, budgets):
            label += f", {row.first.budget}"
        p = row.first.provenance
        source = f"{p.paper} {p.table}" if p else ""
        by_series.setdefault((label, source), {}).setdefault(int(size), []).append(row)
    by_series = {key: sizes for key, sizes in by_series.items() if len(sizes) > 1}
    sources: dict[str, set[str]] = {}
    for label, source in by_series:
        sources.setdefault(label, set()).add(source)
    series = []
    for (label, source), sizes in sorted(by_series.items()):
        pts = [[s, *m.json()] for s in sorted(sizes) if (m := measure(first_of(sizes[s]), sets))]
        shown = f"{label}, {source}" if len(sources[label]) > 1 else label
        series.append({"label": shown, "points": pts, "level": None})
    if not series:
        return f"{task}-wer-vs-cohort: no configuration run at two cohort sizes"
    return Figure(
        f"{task}-wer-vs-cohort",
        task,
        f"{task}: test WER vs cohort size",
        "lines",
        {
            "xlabel": "cohort size S (users per central step)",
            "ylabel": wer_label(sets),
            "xticks": sorted({p[0] for s in series for p in s["points"]}),
            "series": series,
        },
    )


def optimizer_of(record: ResultRecord) -> str:
    server = (((record.config or {}).get("recipe") or {}).get("federated") or {}).get("server")
    if server:
        return server.get("optimizer", "lamb")
    return (
        record.baseline.removeprefix("server-")
        if record.baseline.startswith("server-")
        else ("lamb")
    )


def optimizer_figure(rows, task, sets, budgets, declared) -> Figure | str:
    """Server optimizers side by side, per budget and cohort: runs of the server-* baselines and
    of perlayer-dim (the same recipe with LAMB); reference rows of the server-* baselines and the
    LAMB rows of the tables that print them."""
    tables = {
        (c.paper, c.table)
        for row in rows
        if row.first.baseline.startswith("server-") and row.first.provenance
        for c in (row.first.provenance, *row.first.provenance.also)
    }
    dp_names = task_budget_names(task, budgets, declared)
    groups: dict[tuple, dict[str, list[Row]]] = {}
    for row in rows:
        record = row.first
        if record.kind == "run":
            wanted = record.baseline.startswith("server-") or record.baseline == "perlayer-dim"
            wanted = wanted and not set(overrides_of(record)) - {COHORT_KEY, SERVER_LR_KEY}
        else:
            cited = {(record.provenance.paper, record.provenance.table)} | {
                (c.paper, c.table) for c in record.provenance.also
            }
            wanted = record.baseline.startswith("server-") or bool(cited & tables)
        if not wanted or (dp_of(row, budgets) and record.budget not in dp_names):
            continue
        size = cohort_size(record)
        if size is None:
            continue
        key = (record.budget in dp_names, record.budget, int(size))
        groups.setdefault(key, {}).setdefault(optimizer_of(record), []).append(row)
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return f"{task}-server-optimizers: no two server optimizers at one budget and cohort"
    keys = sorted(groups, key=lambda k: (not k[0], budgets[k[1]].epsilon if k[0] else 0, k[2]))
    categories = [
        (f"ε = {budgets[k[1]].epsilon:g}" if k[0] else NO_DP) + f", S = {k[2]}" for k in keys
    ]
    series = []
    found_optimizers = {o for g in groups.values() for o in g}
    for optimizer in [*OPTIMIZERS, *sorted(found_optimizers - set(OPTIMIZERS))]:
        found = [(i, groups[k][optimizer]) for i, k in enumerate(keys) if optimizer in groups[k]]
        if not found:
            continue
        chosen = [(i, tuned_first(rs)) for i, rs in found]
        names = sorted({r.first.baseline for _, r in chosen})
        pts = [[i, *m.json()] for i, r in chosen if (m := measure(r, sets))]
        label = f"{OPTIMIZERS.get(optimizer, optimizer)} ({', '.join(names)})"
        series.append({"label": label, "points": pts})
    return Figure(
        f"{task}-server-optimizers",
        task,
        f"{task}: server optimizers, by budget and cohort size",
        "categorical",
        {
            "categories": categories,
            "xlabel": "budget, cohort size (where several server lrs ran: the one with the "
            "lowest dev WER)",
            "ylabel": wer_label(sets),
            "connect": False,
            "panels": [{"title": "", "series": series}],
        },
    )


def result_figures(
    records: list[ResultRecord],
    task: str,
    budgets: dict[str, Budget],
    declared: dict[str, list[str]],
    skipped: list[str],
) -> list[Figure]:
    """The figures of one task, each answering one question: WER at each privacy budget per
    method, DP's cost per clipping mode, WER vs cohort size, server optimizers; then the
    per-group and privacy-audit figures. What cannot be drawn is appended to `skipped`."""
    records = [r for r in records if r.task.name == task]
    audits = [r for r in records if is_audit(r)]
    records = [r for r in records if not is_audit(r)]  # their models carry canaries
    rows, sets = group_rows(records), test_sets(records)
    made = [
        epsilon_figure(rows, task, sets, budgets, declared),
        clipping_figure(rows, task, sets, budgets),
        cohort_figure(rows, task, sets, budgets),
        optimizer_figure(rows, task, sets, budgets, declared),
        *group_figures(rows, task, budgets, declared),
        audit_figure(audits, task, skipped),
    ]
    figures = [item for item in made if isinstance(item, Figure)]
    skipped += [item for item in made if isinstance(item, str)]
    for f in figures:  # colour and marker: distinct within a panel, in label order
        for panel in _panels(f):
            palette = styles(s["label"] for s in panel["series"])
            for s in panel["series"]:
                s["style"] = palette[s["label"]]
    return figures


def _panels(figure: Figure) -> list[dict]:
    if figure.kind == "categorical":
        return figure.data["panels"]
    if figure.kind == "lines":
        return [figure.data]
    return []


def test_sets(records: list[ResultRecord]) -> list[str]:
    return sorted({n for r in records for n, e in r.metrics.final.items() if e.role == "test"})


MAX_GROUP_SERIES = 8  # more dot series than this cannot be told apart


def group_figures(rows: list[Row], task: str, budgets, declared: dict) -> list[Figure | str]:
    """Per-group WER (each attribute a panel, each ranked group a column, each row a series)
    and DP's cost per group (group WER under the budget minus the no-DP partner's); at most
    MAX_GROUP_SERIES rows each, chosen by `_group_series_rank`."""
    default_budget = (declared.get(task) or [None])[0]  # a run without --budget gets this one
    eval_set = group_eval_set([r for row in rows for r in row.records])
    if eval_set is None:
        return [f"{task}-group-wer: no records with per-group WER"]
    series_of: dict[tuple[str, str], list[Row]] = {}
    for row in rows:  # rows a series' label cannot tell apart (a stale one, say): first_of's
        series_of.setdefault((row_label(row.first), row.first.budget), []).append(row)
    found = rows_with_groups([first_of(competing) for competing in series_of.values()], eval_set)
    gaps = [
        (row, {a: {n: v.wer - base[a][n].wer for n, v in by_name.items() if n in base.get(a, {})}
               for a, by_name in groups.items()})
        for row, groups, base in dp_pairs(found, lambda b: is_dp(b, budgets))
    ]  # fmt: skip
    wers = [(row, {a: {n: v.wer for n, v in by_name.items()} for a, by_name in g.items()})
            for row, g in found]  # fmt: skip
    ranked: dict[str, set[str]] = {}
    for _, groups in found:
        for a, by_name in groups.items():
            ranked.setdefault(a, set()).update(n for n, v in by_name.items() if is_ranked(n, v))
    attributes = {a: in_natural_order(names) for a, names in sorted(ranked.items()) if names}
    out: list[Figure | str] = []
    for stem, series, ylabel in (
        (f"{task}-group-wer", wers, f"{eval_set} WER (%) of the group"),
        (f"{task}-group-dp-gap", gaps, "WER under DP − WER without DP (points)"),
    ):
        if not series:
            out.append(f"{stem}: no rows to draw")
            continue
        series = sorted(series, key=lambda t: _group_series_rank(t[0], default_budget))
        series = series[:MAX_GROUP_SERIES]
        data = {
            "ylabel": ylabel,
            "attributes": attributes,
            "series": [
                {
                    "label": f"{row_label(row.first)} / {row.first.budget} (n={len(row.records)})",
                    "values": {
                        a: [
                            _round(100 * values[a][n]) if n in values.get(a, {}) else None
                            for n in names
                        ]
                        for a, names in attributes.items()
                    },
                }  # fmt: skip
                for row, values in series
            ],
        }
        title = f"{task}: {ylabel.split(' (')[0]} per speaker group"
        out.append(Figure(stem, task, title, "groups", data))
    return out


def _group_series_rank(row: Row, default_budget: str | None) -> tuple:
    """Which rows a group figure shows first: plain configurations (no --set overrides); of
    those the anchors without DP (seed-only, fedavg, central: what training does for each
    group), then the methods under the task's default budget, then the rest; more seeds first,
    then by family (the WER-vs-ε figure's panels) and name. Ranking by name alone filled the
    figure with whatever sorted first (adaptive-*, bandmf-*) and left out fedavg."""
    first = row.first
    kind = family(first.baseline)
    anchor = first.budget == "none" and kind == "other"
    place = 0 if anchor else 1 if first.budget == default_budget else 2
    rank = FAMILY_ORDER.index(kind)  # "other" last
    return (bool(overrides_of(first)), place, -len(row.records), rank, first.baseline,
            first.budget)  # fmt: skip


def audit_figure(records: list[ResultRecord], task: str, skipped: list[str]) -> Figure | None:
    """Audit ε (estimate, and lower bound below it) against the accountant's ε at the simulated
    scale, one series per baseline / budget; the diagonal is where the audit would meet it."""
    stem = f"{task}-privacy-audit"
    drawn = []
    for record in sorted(records, key=lambda r: r.record_id):
        found = epsilon(record, "simulated")
        if found is None or not math.isfinite(found[0]):
            skipped.append(f"{stem}: {record.record_id} has no finite accountant ε")
            continue
        audit = record.privacy.audit
        drawn.append([f"{record.baseline} / {record.budget}", found[0], audit.epsilon_estimate,
                      audit.epsilon_lower_bound])  # fmt: skip
    if not drawn:
        return None
    title = f"{task}: empirical privacy audit vs accountant"
    return Figure(stem, task, title, "audit", {"points": sorted(drawn)})


# ----------------------------------------------------------------------------------------------
# The figures folder: PNGs plus a manifest of their digests


def all_result_figures(
    records: list[ResultRecord], budgets: dict[str, Budget], declared: dict[str, list[str]],
    task: str | None = None,
) -> tuple[list[Figure], list[str]]:  # fmt: skip
    """Every task's result figures (or one task's), and what could not be drawn."""
    skipped: list[str] = []
    figures = []
    for name in sorted({r.task.name for r in records} if task is None else {task}):
        safe_name(name, "task name")
        figures += result_figures(records, name, budgets, declared, skipped)
    return figures, skipped


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        raise UserError(f"{path}: not valid JSON (delete it and run `pflbench plot`)") from None
    return data if isinstance(data, dict) else {}


def stale_figures(figures: list[Figure], folder: Path) -> list[str]:
    """What is wrong with the folder for these figures: 'stem: why' per missing, stale or extra
    figure (cheap: compares digests of the figures' data, draws nothing)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    problems = []
    for f in figures:
        entry = manifest.get(f.stem) or {}
        if not (folder / f"{f.stem}.png").is_file():
            problems.append(f"{f.stem}: missing")
        elif entry.get("digest") != f.digest:
            problems.append(f"{f.stem}: drawn from other data than the records now give")
    wanted = {f.stem for f in figures}
    extra = {p.stem for p in folder.glob("*.png")} | set(manifest)
    problems += [f"{stem}: no longer a figure of the results" for stem in sorted(extra - wanted)]
    return problems


def figure_links(figures: list[Figure], folder: str) -> dict[str, str]:
    """Per task, markdown embedding its figures (folder: relative to leaderboard.md)."""
    by_task: dict[str, list[Figure]] = {}
    for f in figures:
        by_task.setdefault(f.task, []).append(f)
    return {
        task: "### figures\n\n"
        + "\n\n".join(f"![{f.title}]({folder}/{f.stem}.png)" for f in found)
        + "\n"
        for task, found in by_task.items()
    }
