"""Validity of an embedded task: does it rank the baselines the way the paper's real task does?

A configuration is (baseline, budget). On the embedded task it is the task's default configuration
of the baseline (runs without --set overrides, current task version), its WER the mean over seeds
of the mean over the task's test sets, under a budget the task declares (or one without DP); a
signal-to-noise-matched budget stands for the paper budget it `matches`. On the paper task it is a
reference row of the paper's Table 1 (test WER). Over the configurations both have, Kendall's τ-b
between the two WER orders (ties counted as neither concordant nor discordant), with every pair's
agreement listed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from itertools import combinations

from pflbench.results.schema import ResultRecord
from pflbench.spec.models import Budget

# Embedded task -> the paper task it is the CPU-sized analogue of. Kept here, not in the task
# spec, so that declaring it does not change any run's resolved config (and config hash).
VALIDITY_PAIRS = {"synth-cv-en-ls-seed": "cv-en-ls100-seed"}
PAPER_TABLE = "Table 1"

Configuration = tuple[str, str]  # (baseline, paper budget)


@dataclass(frozen=True)
class Pair:
    first: Configuration
    second: Configuration
    paper: int  # sign of WER(first) - WER(second) on the paper task: -1, 0, 1
    embedded: int

    @property
    def agreement(self) -> str:
        if self.paper == 0 or self.embedded == 0:
            return "tie"
        return "agree" if self.paper == self.embedded else "disagree"


@dataclass(frozen=True)
class ValidityReport:
    task: str
    against: str
    paper_wer: dict[Configuration, float]
    embedded_wer: dict[Configuration, float]
    seeds: dict[Configuration, int]
    embedded_budget: dict[Configuration, str]  # the embedded budget behind each configuration

    @property
    def common(self) -> list[Configuration]:
        return sorted(set(self.paper_wer) & set(self.embedded_wer))

    @property
    def pairs(self) -> list[Pair]:
        return [
            Pair(a, b, sign(self.paper_wer, a, b), sign(self.embedded_wer, a, b))
            for a, b in combinations(self.common, 2)
        ]

    @property
    def tau(self) -> float | None:
        return kendall_tau_b(
            [self.paper_wer[c] for c in self.common], [self.embedded_wer[c] for c in self.common]
        )


def sign(wer: dict[Configuration, float], a: Configuration, b: Configuration) -> int:
    diff = wer[a] - wer[b]
    return (diff > 0) - (diff < 0)


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


def paper_budget(name: str, budgets: dict[str, Budget]) -> str:
    budget = budgets.get(name)
    if budget is None:
        return name
    if not budget.dp:
        return "none"
    return budget.matches or name


def validity_report(
    records: list[ResultRecord],
    task: str,
    against: str,
    budgets: dict[str, Budget],
    task_budgets: list[str] | None = None,
    task_version: int | None = None,
) -> ValidityReport:
    """task_budgets: the embedded task's declared budgets (runs under other DP budgets are left
    out, so two budgets matching one paper budget cannot both count); None keeps every budget."""
    paper = {}
    for r in records:
        if r.task.name == against and r.kind == "reference" and r.provenance is not None:
            if r.provenance.table == PAPER_TABLE and mean_test_wer(r) is not None:
                paper[(r.baseline, r.budget)] = mean_test_wer(r)
    runs: dict[Configuration, list[float]] = {}
    embedded_budget: dict[Configuration, str] = {}
    for r in records:
        if r.task.name != task or r.kind != "run" or (r.config or {}).get("overrides"):
            continue
        if task_version is not None and r.task.version != task_version:
            continue
        budget = budgets.get(r.budget)
        declared = task_budgets is None or r.budget in task_budgets
        if not declared and not (budget is not None and not budget.dp):
            continue
        wer = mean_test_wer(r)
        if wer is None:
            continue
        key = (r.baseline, paper_budget(r.budget, budgets))
        runs.setdefault(key, []).append(wer)
        embedded_budget[key] = r.budget
    return ValidityReport(
        task,
        against,
        paper,
        {k: statistics.fmean(v) for k, v in runs.items()},
        {k: len(v) for k, v in runs.items()},
        embedded_budget,
    )


def render_validity(report: ValidityReport) -> str:
    common = report.common
    lines = [
        f"### Validity: `{report.task}` against `{report.against}` (paper {PAPER_TABLE})\n",
        "Does the embedded task rank the baselines as the paper's task does? Configurations = "
        "(baseline, budget) both have: the embedded task's default configuration (no --set, "
        "current version) under its declared budgets, each standing for the paper budget it "
        "matches; test WER, mean over seeds. Kendall τ-b over them; ties are neither concordant "
        "nor discordant.\n",
    ]
    if len(common) < 2:

        def listed(wers: dict) -> str:
            return ", ".join(f"{b}/{g}" for b, g in sorted(wers)) or "none"

        lines.append(
            f"Not enough configurations in common yet ({len(common)}; need 2). Paper: "
            f"{listed(report.paper_wer)}. Embedded: {listed(report.embedded_wer)}.\n"
        )
        return "\n".join(lines)
    tau = report.tau
    lines.append(
        f"**Kendall τ-b = {'–' if tau is None else f'{tau:.3f}'}** over {len(common)} "
        f"configurations ({len(report.pairs)} pairs).\n"
    )
    paper_rank = {c: i for i, c in enumerate(sorted(common, key=report.paper_wer.get), 1)}
    embedded_rank = {c: i for i, c in enumerate(sorted(common, key=report.embedded_wer.get), 1)}
    lines += [
        "| baseline | budget (paper) | budget (embedded) | paper WER | paper rank | embedded WER "
        "(seeds) | embedded rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in sorted(common, key=report.paper_wer.get):
        lines.append(
            f"| {c[0]} | {c[1]} | {report.embedded_budget[c]} | {100 * report.paper_wer[c]:.2f} | "
            f"{paper_rank[c]} | {100 * report.embedded_wer[c]:.2f} ({report.seeds[c]}) | "
            f"{embedded_rank[c]} |"
        )
    lines += ["", "| pair (A vs B) | paper | embedded | |", "|---|---|---|---|"]
    symbol = {-1: "A < B", 0: "A = B", 1: "A > B"}
    for p in report.pairs:
        lines.append(
            f"| {p.first[0]}/{p.first[1]} vs {p.second[0]}/{p.second[1]} | {symbol[p.paper]} | "
            f"{symbol[p.embedded]} | {p.agreement} |"
        )
    missing = sorted(set(report.paper_wer) - set(report.embedded_wer))
    if missing:
        lines.append(
            "\nPaper configurations without embedded runs: "
            + ", ".join(f"{b}/{g}" for b, g in missing)
            + "."
        )
    return "\n".join(lines) + "\n"
