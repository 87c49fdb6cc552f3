"""Validity of an embedded task: does it rank configurations the way the paper's tables do?

Each paper table in VALIDITY_TABLES answers one question on the paper's task (noise level and
clipping mode, server optimizer, cohort size, FedProx). Over the configurations both the table and
the embedded task have, the two WER orders are compared by Kendall's τ-b (ties counted as neither
concordant nor discordant), with every pair's agreement listed.

A configuration is (baseline, paper budget, cohort size):
- the table's side: the reference rows of its paper task that cite the table (as their source or
  `also`; results/paper.py), test WER as recorded. Where rows of the table share a configuration
  (the clip bound ablation, local epochs vs steps at one cohort), the one with the fewest --set
  overrides stands for it and the others are listed as left out;
- the embedded side: runs of the embedded task at its current version under a budget the task
  declares (standing for the paper budget it `matches`) or without DP, with no --set overrides
  but the cohort size and the table's `tuned` keys; WER = mean over seeds of the mean over the
  test sets. Where a table's rows carry hyperparameters the paper tuned per configuration (Table
  9: each server optimizer's lr), the embedded runs of a configuration may differ in those keys,
  and the setting with the lowest dev WER (on the dev sets of the test sets' corpus, mean over
  its seeds) stands for the configuration: tuned on the dev split, as the paper's were, never on
  the test split;
- the cohort: with cohorts "default" each side runs at its task's cohort (the paper's 1,024 stands
  for the embedded task's 16; runs at other cohorts are left out), with "absolute" the cohort size
  is part of the configuration.

A pair's embedded WER difference carries a paired bootstrap 95% CI over speakers and seeds
(results/stats.py) where the runs have per-speaker counts on a single test set: a disagreement
whose CI includes 0 is one the embedded task cannot resolve, not evidence against it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from itertools import combinations
from typing import Literal

from pflbench.results.leaderboard import cohort_size
from pflbench.results.schema import ResultRecord
from pflbench.results.stats import Interval, difference_interval, record_counts
from pflbench.spec.models import Budget
from pflbench.spec.resolve import set_values

COHORT_KEY = "federated.cohort_size"
SERVER_LR_KEY = "federated.server.lr"


@dataclass(frozen=True)
class PaperTable:
    paper: str
    table: str
    against: str  # the paper's task the table's rows are on
    question: str
    cohorts: Literal["default", "absolute"]
    # --set keys the paper tuned per configuration: the embedded side tunes them on dev.
    tuned: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.paper} {self.table}"


# Embedded task -> the paper tables whose configurations it runs. Kept here, not in the task spec,
# so that declaring them does not change any run's resolved config (and config hash).
VALIDITY_TABLES = {
    "synth-cv-en-ls-seed": (
        PaperTable("002", "Table 1", "cv-en-ls100-seed", "noise level × clipping mode", "default"),
        PaperTable(
            "002", "Table 17", "cv-en-ls100-seed", "the full noise grid × clipping", "default"
        ),
        PaperTable(
            "002",
            "Table 9",
            "cv-en90-cv10-seed",
            "server optimizer (the paper compares them on seeded CV-en only from a CV-en-10 seed)",
            "absolute",
            tuned=(SERVER_LR_KEY,),
        ),
        PaperTable("002", "Table 16", "cv-en-ls100-seed", "cohort size", "absolute"),
        PaperTable("002", "Table 13", "cv-en-ls100-seed", "FedProx", "absolute"),
    )
}

Configuration = tuple[str, str, int | None]  # (baseline, paper budget, cohort size or None)


def describe(c: Configuration) -> str:
    return f"{c[0]}/{c[1]}" + ("" if c[2] is None else f"/S={c[2]}")


@dataclass(frozen=True)
class Pair:
    first: Configuration
    second: Configuration
    paper: int  # sign of WER(first) - WER(second) on the paper's task: -1, 0, 1
    embedded: int
    paper_difference: float  # WER(first) - WER(second), fractions
    embedded_difference: float
    embedded_interval: Interval | None  # paired bootstrap CI of the embedded difference

    @property
    def agreement(self) -> str:
        if self.paper == 0 or self.embedded == 0:
            return "tie"
        return "agree" if self.paper == self.embedded else "disagree"

    @property
    def resolved(self) -> bool | None:
        """Whether the embedded difference is beyond seed and speaker-sampling noise (None: no
        per-speaker counts to tell)."""
        interval = self.embedded_interval
        return None if interval is None else interval.excludes(0.0)


@dataclass(frozen=True)
class Setting:
    """One setting of a table's tuned keys on the embedded side (() = as the specs resolve)."""

    values: tuple[tuple[str, str], ...]  # (key, value as given to --set)
    dev_wer: float | None  # dev_wer(runs)
    runs: tuple[ResultRecord, ...]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values) or "as specified (no --set)"


@dataclass
class TableReport:
    spec: PaperTable
    task: str
    paper_wer: dict[Configuration, float] = field(default_factory=dict)
    left_out: list[tuple[ResultRecord, Configuration]] = field(default_factory=list)
    embedded_wer: dict[Configuration, float] = field(default_factory=dict)
    embedded_runs: dict[Configuration, list[ResultRecord]] = field(default_factory=dict)
    embedded_budget: dict[Configuration, str] = field(default_factory=dict)
    # Configurations run at several settings of the table's tuned keys: every setting, its dev
    # WER and runs, the chosen one first.
    tuning: dict[Configuration, list[Setting]] = field(default_factory=dict)
    pairs: list[Pair] = field(default_factory=list)

    @property
    def common(self) -> list[Configuration]:
        return sorted(set(self.paper_wer) & set(self.embedded_wer), key=_order)

    @property
    def tau(self) -> float | None:
        return kendall_tau_b(
            [self.paper_wer[c] for c in self.common], [self.embedded_wer[c] for c in self.common]
        )

    def count(self, agreement: str) -> int:
        return sum(p.agreement == agreement for p in self.pairs)


def _order(c: Configuration) -> tuple:
    return (c[0], c[1], -1 if c[2] is None else c[2])


def sign(value: float) -> int:
    return (value > 0) - (value < 0)


def kendall_tau_b(x: list[float], y: list[float]) -> float | None:
    """τ-b = (C - D) / sqrt((n0 - n1)(n0 - n2)); None with fewer than 2 items or a constant side."""
    n = len(x)
    concordant = discordant = ties_x = ties_y = 0
    for i, j in combinations(range(n), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        ties_x += dx == 0
        ties_y += dy == 0
        if dx * dy > 0:
            concordant += 1
        elif dx * dy < 0:
            discordant += 1
    pairs = n * (n - 1) // 2
    denominator = math.sqrt((pairs - ties_x) * (pairs - ties_y))
    return (concordant - discordant) / denominator if denominator else None


def mean_test_wer(record: ResultRecord) -> float | None:
    wers = [r.wer for r in record.metrics.final.values() if r.role == "test"]
    return statistics.fmean(wers) if wers else None


def tuning_wer(record: ResultRecord) -> float | None:
    """What a tuned setting is chosen by: the mean WER over the dev sets on the corpus of the
    run's test sets (cv-dev for a Common-Voice-like test set, not ls-dev-clean, the seed
    model's domain)."""
    eval_sets = ((record.config or {}).get("task") or {}).get("eval_sets") or []
    test_corpora = {e.get("corpus") for e in eval_sets if e.get("role") == "test"}
    dev_sets = {
        e.get("name")
        for e in eval_sets
        if e.get("role") == "dev" and e.get("corpus") in test_corpora
    }
    final = record.metrics.final.items()
    wers = [e.wer for name, e in final if name in dev_sets and e.role == "dev"]
    return statistics.fmean(wers) if wers else None


def dev_wer(runs) -> float | None:
    """A setting's dev WER: the mean over its runs of tuning_wer (None: no run has one)."""
    wers = [w for r in runs if (w := tuning_wer(r)) is not None]
    return statistics.fmean(wers) if wers else None


def _tuning_order(setting: Setting) -> tuple:
    """The lowest dev WER first; settings without one last; ties by their values."""
    return (setting.dev_wer is None, setting.dev_wer or 0.0, setting.values)


def paper_budget(name: str, budgets: dict[str, Budget]) -> str:
    budget = budgets.get(name)
    if budget is None:
        return name
    if not budget.dp:
        return "none"
    return budget.matches or name


def cites(record: ResultRecord, paper: str, table: str) -> bool:
    p = record.provenance
    if p is None:
        return False
    return (p.paper, p.table) == (paper, table) or any(
        (c.paper, c.table) == (paper, table) for c in p.also
    )


def _cohort(record: ResultRecord, spec: PaperTable, overridden: bool) -> tuple[bool, int | None]:
    """(whether the record takes part, the configuration's cohort)."""
    if spec.cohorts == "absolute":
        size = cohort_size(record)
        return True, None if size is None else int(size)
    return not overridden, None


def table_report(
    records: list[ResultRecord],
    task: str,
    spec: PaperTable,
    budgets: dict[str, Budget],
    task_budgets: list[str] | None = None,
    task_version: int | None = None,
) -> TableReport:
    """task_budgets: the embedded task's declared budgets (runs under other DP budgets are left
    out, so two budgets matching one paper budget cannot both count); None keeps every budget."""
    report = TableReport(spec, task)
    candidates: dict[Configuration, list[ResultRecord]] = {}
    for r in records:
        if r.task.name != spec.against or r.kind != "reference" or mean_test_wer(r) is None:
            continue
        if not cites(r, spec.paper, spec.table):
            continue
        takes_part, cohort = _cohort(r, spec, COHORT_KEY in r.provenance.overrides)
        if takes_part:
            candidates.setdefault((r.baseline, r.budget, cohort), []).append(r)
    for key, rows in candidates.items():
        rows.sort(key=lambda r: (len(r.provenance.overrides), r.record_id))
        report.paper_wer[key] = mean_test_wer(rows[0])
        report.left_out += [(r, key) for r in rows[1:]]
    runs: dict[Configuration, dict[tuple, list[ResultRecord]]] = {}
    for r in records:
        if r.task.name != task or r.kind != "run":
            continue
        overrides = set_values(r.config or {})  # one spelling of each value: one setting
        if set(overrides) - {COHORT_KEY, *spec.tuned} or (
            task_version is not None and r.task.version != task_version
        ):
            continue
        budget = budgets.get(r.budget)
        declared = task_budgets is None or r.budget in task_budgets
        if not declared and not (budget is not None and not budget.dp):
            continue
        takes_part, cohort = _cohort(r, spec, COHORT_KEY in overrides)
        if takes_part and mean_test_wer(r) is not None:
            key = (r.baseline, paper_budget(r.budget, budgets), cohort)
            values = tuple(sorted((k, str(v)) for k, v in overrides.items() if k in spec.tuned))
            runs.setdefault(key, {}).setdefault(values, []).append(r)
            report.embedded_budget[key] = r.budget
    for key, by_values in runs.items():
        settings = sorted(
            (
                Setting(values, dev_wer(v), tuple(sorted(v, key=lambda r: r.record_id)))
                for values, v in by_values.items()
            ),
            key=_tuning_order,
        )
        report.embedded_runs[key] = list(settings[0].runs)
        if len(settings) > 1:
            report.tuning[key] = settings
    report.embedded_wer = {
        k: statistics.fmean(mean_test_wer(r) for r in v) for k, v in report.embedded_runs.items()
    }
    for a, b in combinations(report.common, 2):
        paper = report.paper_wer[a] - report.paper_wer[b]
        embedded = report.embedded_wer[a] - report.embedded_wer[b]
        interval = embedded_interval(report.embedded_runs[a], report.embedded_runs[b])
        report.pairs.append(Pair(a, b, sign(paper), sign(embedded), paper, embedded, interval))
    return report


def embedded_interval(side_a: list[ResultRecord], side_b: list[ResultRecord]) -> Interval | None:
    """Paired bootstrap CI of WER(A) - WER(B) on the single test set both sides were scored on,
    or None (several test sets, or records without per-speaker counts)."""
    sets = {n for r in [*side_a, *side_b] for n, e in r.metrics.final.items() if e.role == "test"}
    if len(sets) != 1:
        return None
    (name,) = sets
    a = [record_counts(r, name) for r in side_a]
    b = [record_counts(r, name) for r in side_b]
    if any(c is None for c in a + b):
        return None
    return difference_interval(a, b)


def validity_reports(
    records: list[ResultRecord],
    task: str,
    budgets: dict[str, Budget],
    task_budgets: list[str] | None = None,
    task_version: int | None = None,
    tables: list[str] | None = None,
) -> list[TableReport]:
    """One report per paper table of VALIDITY_TABLES[task] (or the ones named "002 Table 9")."""
    specs = VALIDITY_TABLES.get(task, ())
    if tables is not None:
        specs = [s for s in specs if s.name in tables]
    return [
        table_report(records, task, spec, budgets, task_budgets, task_version) for spec in specs
    ]


# ----------------------------------------------------------------------------------------------
# Markdown


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def _tau(report: TableReport) -> str:
    tau = report.tau
    return "–" if tau is None else f"{tau:.3f}"


def _disagreements(report: TableReport) -> str:
    """How many pairs disagree, and how many of those the embedded task cannot resolve (pairs
    whose runs lack per-speaker counts are not tested)."""
    wrong = [p for p in report.pairs if p.agreement == "disagree"]
    tested = [p for p in wrong if p.resolved is not None]
    if not tested:
        return str(len(wrong))
    untested = len(wrong) - len(tested)
    within = sum(not p.resolved for p in tested)
    return f"{len(wrong)} ({within} within noise" + (f", {untested} untested)" if untested else ")")


def render_validity(reports: list[TableReport]) -> str:
    """The validity table (one line per paper table) and each table's configurations and pairs."""
    if not reports:
        return ""
    task = reports[0].task
    lines = [
        f"### Validity: `{task}` against the paper's tables\n",
        "Does the embedded task rank configurations as the paper's tables do? Per table, the "
        "configurations (baseline, budget, cohort) both have: the table's reference rows on its "
        "task, and the embedded task's runs at its current version without --set overrides but "
        "the cohort (and, where the paper tuned a hyperparameter per configuration, that one: "
        "the setting with the lowest dev WER stands for the configuration), under its declared "
        "budgets (each standing for the paper budget it matches) or without DP; test WER, mean "
        "over seeds. Kendall τ-b over them (ties neither concordant "
        "nor discordant). A disagreement is *within noise* when the 95% CI of the embedded "
        "difference (paired bootstrap over speakers and seeds) includes 0: the embedded task "
        "cannot resolve that pair. pflbench.results.validity.\n",
        "| paper table | question | paper task | configurations | pairs | agree | disagree "
        "(within noise) | ties | Kendall τ-b |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        lines.append(
            f"| {r.spec.name} | {r.spec.question} | {r.spec.against} | {len(r.common)} | "
            f"{len(r.pairs)} | {r.count('agree')} | {_disagreements(r)} | {r.count('tie')} | "
            f"{_tau(r)} |"
        )
    lines.append("")
    for r in reports:
        lines.append(render_table_report(r))
    return "\n".join(lines)


def render_table_report(report: TableReport) -> str:
    common, spec = report.common, report.spec
    cohorts = (
        "each side at its task's cohort (paper 1,024, embedded task its own)"
        if spec.cohorts == "default"
        else "the cohort size is part of the configuration"
    )
    lines = [f"#### {spec.name}: {spec.question}\n", f"Paper task `{spec.against}`; {cohorts}.\n"]
    if len(common) < 2:

        def listed(wers: dict) -> str:
            return ", ".join(describe(c) for c in sorted(wers, key=_order)) or "none"

        lines.append(
            f"Not enough configurations in common ({len(common)}; need 2). Paper: "
            f"{listed(report.paper_wer)}. Embedded: {listed(report.embedded_wer)}.\n"
        )
        return "\n".join(lines)
    lines.append(
        f"**Kendall τ-b = {_tau(report)}** over {len(common)} configurations "
        f"({len(report.pairs)} pairs: {report.count('agree')} agree, "
        f"{_disagreements(report)} disagree, {report.count('tie')} ties).\n"
    )
    paper_rank = {c: i for i, c in enumerate(sorted(common, key=report.paper_wer.get), 1)}
    embedded_rank = {c: i for i, c in enumerate(sorted(common, key=report.embedded_wer.get), 1)}
    lines += [
        "| baseline | budget (paper) | cohort | budget (embedded) | paper WER | paper rank | "
        "embedded WER (seeds) | embedded rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(common, key=report.paper_wer.get):
        lines.append(
            f"| {c[0]} | {c[1]} | {'default' if c[2] is None else c[2]} | "
            f"{report.embedded_budget[c]} | {_pct(report.paper_wer[c])} | {paper_rank[c]} | "
            f"{_pct(report.embedded_wer[c])} ({len(report.embedded_runs[c])}) | "
            f"{embedded_rank[c]} |"
        )
    lines += ["", render_pairs(report)]
    if report.tuning:
        lines.append(render_tuning(report))
    missing = sorted(set(report.paper_wer) - set(report.embedded_wer), key=_order)
    if missing:
        lines.append(
            "Paper configurations without embedded runs: "
            + ", ".join(describe(c) for c in missing)
            + ".\n"
        )
    if report.left_out:
        lines.append(
            "Paper rows left out (another row of the table with fewer --set overrides stands for "
            "their configuration): "
            + ", ".join(
                f"{describe(c)} [{_overrides(r)}]"
                for r, c in sorted(report.left_out, key=lambda t: (_order(t[1]), t[0].record_id))
            )
            + ".\n"
        )
    return "\n".join(lines)


def render_tuning(report: TableReport) -> str:
    """Each tuned configuration's settings, chosen first: dev WER (what chose) and test WER."""
    keys = ", ".join(report.spec.tuned)
    lines = [
        f"Tuned on the dev split ({keys}; the dev sets of the test sets' corpus, mean over "
        "seeds; the paper tuned it per configuration too). The chosen setting stands for its "
        "configuration above:\n",
        "| configuration | setting | dev WER | test WER (seeds) | |",
        "|---|---|---|---|---|",
    ]
    for c in sorted(report.tuning, key=_order):
        for i, setting in enumerate(report.tuning[c]):
            dev = "–" if setting.dev_wer is None else _pct(setting.dev_wer)
            test = statistics.fmean(mean_test_wer(r) for r in setting.runs)
            lines.append(
                f"| {describe(c)} | {setting.describe()} | {dev} | {_pct(test)} "
                f"({len(setting.runs)}) | {'chosen' if i == 0 else ''} |"
            )
    return "\n".join(lines) + "\n"


def _overrides(record: ResultRecord) -> str:
    return ", ".join(f"{k}={v}" for k, v in record.provenance.overrides.items())


def render_pairs(report: TableReport) -> str:
    """Every pair, disagreements first; differences WER(A) - WER(B) in points."""
    symbol = {-1: "A < B", 0: "A = B", 1: "A > B"}
    order = {"disagree": 0, "tie": 1, "agree": 2}
    lines = [
        f"<details><summary>{len(report.pairs)} pairs (disagreements first)</summary>\n",
        "| pair (A vs B) | paper | A − B (paper) | embedded | A − B (embedded) [95% CI] | |",
        "|---|---|---|---|---|---|",
    ]
    for p in sorted(report.pairs, key=lambda p: order[p.agreement]):
        interval = p.embedded_interval
        ci = "" if interval is None else f" [{100 * interval.low:+.2f}, {100 * interval.high:+.2f}]"
        verdict = p.agreement
        if p.agreement == "disagree" and p.resolved is False:
            verdict += " (within noise)"
        lines.append(
            f"| {describe(p.first)} vs {describe(p.second)} | {symbol[p.paper]} | "
            f"{100 * p.paper_difference:+.2f} | {symbol[p.embedded]} | "
            f"{100 * p.embedded_difference:+.2f}{ci} | {verdict} |"
        )
    lines.append("\n</details>\n")
    return "\n".join(lines)
