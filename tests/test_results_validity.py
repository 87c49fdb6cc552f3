"""pflbench validity: Kendall τ-b between an embedded task's ranking and the paper's Table 1."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from scipy.stats import kendalltau

from pflbench.results.leaderboard import load_results
from pflbench.results.validity import kendall_tau_b, render_validity, validity_report
from pflbench.spec.models import Budget

GOLDEN = Path(__file__).parent / "fixtures" / "results" / "golden" / "results"
BUDGETS = {
    "none": Budget(name="none", dp=False),
    "eps7.2-high-pop": Budget(
        name="eps7.2-high-pop", epsilon=7.2, delta=1e-9, population=10_000, cohort=100, steps=50
    ),
    "eps7.2-m": Budget(
        name="eps7.2-m", epsilon=7.2, delta=1e-9, population=1_000, cohort=10, steps=50,
        matches="eps7.2-high-pop", matched_parameters=1_000_000,
    ),
    "eps7.2-other": Budget(
        name="eps7.2-other", epsilon=7.2, delta=1e-9, population=2_000, cohort=10, steps=50,
        matches="eps7.2-high-pop", matched_parameters=1_000_000,
    ),
}  # fmt: skip


def test_kendall_tau_b_on_known_orders_and_against_scipy():
    assert kendall_tau_b([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau_b([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)  # one swap of 6
    assert kendall_tau_b([1, 2], [5, 5]) is None and kendall_tau_b([1], [1]) is None
    rng = random.Random(0)
    for _ in range(20):  # with ties on both sides, τ-b as scipy defines it
        x = [rng.randint(0, 4) for _ in range(8)]
        y = [rng.randint(0, 4) for _ in range(8)]
        expected = kendalltau(x, y).statistic
        ours = kendall_tau_b(x, y)
        assert (ours is None and expected != expected) or ours == pytest.approx(expected)


def _template(kind: str):
    return next(r for r in load_results(GOLDEN) if r.kind == kind)


def paper_row(baseline: str, budget: str, wer: float, table: str = "Table 1"):
    t = _template("reference")
    final = {"cv-test": t.metrics.final[next(iter(t.metrics.final))].model_copy(
        update={"role": "test", "wer": wer})}  # fmt: skip
    return t.model_copy(
        update={
            "task": t.task.model_copy(update={"name": "paper-task", "version": 1}),
            "baseline": baseline,
            "budget": budget,
            "provenance": t.provenance.model_copy(update={"table": table}),
            "metrics": t.metrics.model_copy(update={"final": final}),
        }
    )


def run_row(baseline: str, budget: str, wer: float, version: int = 3, overrides=None):
    t = _template("run")
    test = next(r for r in t.metrics.final.values() if r.role == "test")
    final = {"cv-test": test.model_copy(update={"wer": wer})}
    return t.model_copy(
        update={
            "task": t.task.model_copy(update={"name": "embedded", "version": version}),
            "baseline": baseline,
            "budget": budget,
            "config": {**t.config, "overrides": overrides or {}},
            "metrics": t.metrics.model_copy(update={"final": final}),
        }
    )


def records():
    return [
        paper_row("seed-only", "none", 0.61),
        paper_row("global", "eps7.2-high-pop", 0.31),
        paper_row("perlayer-dim", "eps7.2-high-pop", 0.20),
        paper_row("perlayer-uniform", "none", 0.19),
        paper_row("fedavg", "none", 0.29, table="Table 4"),  # not Table 1: left out
        run_row("seed-only", "none", 0.70),
        run_row("seed-only", "none", 0.72),
        run_row("global", "eps7.2-m", 0.50),
        run_row("perlayer-dim", "eps7.2-m", 0.44),  # swapped with perlayer-uniform/none
        run_row("perlayer-uniform", "none", 0.46),
        run_row("perlayer-uniform", "none", 0.40),
        # left out: a --set variant, an older task version, an undeclared DP budget
        run_row("global", "eps7.2-m", 0.01, overrides={"recipe.federated.cohort_size": "32"}),
        run_row("global", "eps7.2-m", 0.01, version=2),
        run_row("global", "eps7.2-other", 0.01),
    ]


def test_validity_report_on_hand_made_records_with_a_known_tau():
    report = validity_report(records(), "embedded", "paper-task", BUDGETS, ["eps7.2-m"], 3)
    assert report.common == [
        ("global", "eps7.2-high-pop"),
        ("perlayer-dim", "eps7.2-high-pop"),
        ("perlayer-uniform", "none"),
        ("seed-only", "none"),
    ]
    assert report.embedded_wer[("seed-only", "none")] == pytest.approx(0.71)  # mean of 2 seeds
    assert report.seeds[("perlayer-uniform", "none")] == 2
    # perlayer-uniform/none averages 0.43 < 0.44: the paper's order for that pair holds; all 6
    # pairs agree.
    assert report.tau == 1.0
    swapped = records() + [run_row("perlayer-uniform", "none", 0.50)]  # mean 0.4533 > 0.44
    report = validity_report(swapped, "embedded", "paper-task", BUDGETS, ["eps7.2-m"], 3)
    assert report.tau == pytest.approx(4 / 6)
    assert [p.agreement for p in report.pairs].count("disagree") == 1
    disagreeing = next(p for p in report.pairs if p.agreement == "disagree")
    assert {disagreeing.first[0], disagreeing.second[0]} == {"perlayer-dim", "perlayer-uniform"}
    text = render_validity(report)
    assert "Kendall τ-b = 0.667** over 4 configurations (6 pairs)" in text
    assert text.count("| disagree |") == 1 and text.count("| agree |") == 5
    assert "| perlayer-dim | eps7.2-high-pop | eps7.2-m | 20.00 | 2 | 44.00 (1) | 1 |" in text


def test_validity_needs_two_shared_configurations_and_says_what_is_missing():
    only_paper = [r for r in records() if r.kind == "reference"]
    report = validity_report(only_paper, "embedded", "paper-task", BUDGETS, ["eps7.2-m"], 3)
    assert report.tau is None
    assert "Not enough configurations in common yet (0; need 2)" in render_validity(report)


def test_reversing_the_embedded_ranking_gives_minus_one():
    paper = [r for r in records() if r.kind == "reference"]
    wers = {c: 1 - r.metrics.final["cv-test"].wer for c, r in
            ((r.baseline, r) for r in paper if r.provenance.table == "Table 1")}  # fmt: skip
    budgets = {"seed-only": "none", "perlayer-uniform": "none"}
    runs = [run_row(b, budgets.get(b, "eps7.2-m"), w) for b, w in wers.items()]
    report = validity_report(paper + runs, "embedded", "paper-task", BUDGETS, ["eps7.2-m"], 3)
    assert len(report.common) == 4 and report.tau == -1.0
    assert all(p.agreement == "disagree" for p in report.pairs)
    assert len(list(itertools.combinations(report.common, 2))) == len(report.pairs)
