"""pflbench validity: Kendall τ-b between an embedded task's ranking and each paper table's."""

from __future__ import annotations

import copy
import itertools
import json
import random
from pathlib import Path

import pytest
import yaml
from scipy.stats import kendalltau
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.results.leaderboard import load_results
from pflbench.results.schema import Citation, PrivacyClaim
from pflbench.results.validity import (
    PaperTable,
    kendall_tau_b,
    render_table_report,
    render_validity,
    table_report,
)
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


PAPER = "A fixture paper"
TABLE_1 = PaperTable(PAPER, "Table 1", "paper-task", "noise × clipping", "default")
COHORTS = PaperTable(PAPER, "Table 16", "paper-task", "cohort size", "absolute")


def paper_row(baseline, budget, wer, table="Table 1", overrides=None, also=(), cohort=None):
    t = _template("reference")
    final = {"cv-test": t.metrics.final[next(iter(t.metrics.final))].model_copy(
        update={"role": "test", "wer": wer})}  # fmt: skip
    provenance = t.provenance.model_copy(update={
        "table": table, "overrides": overrides or {},
        "also": [Citation(paper=PAPER, table=name, row="r") for name in also]})  # fmt: skip
    privacy = None
    if cohort is not None:  # a federated reference row states its cohort in its claim
        simulated = {"population": 1000, "cohort": cohort, "steps": 1, "epsilon": {},
                     "sampling_rate": cohort / 1000, "noise_multiplier": 0.0}  # fmt: skip
        privacy = {"dp": False, "simulated": simulated}
    return t.model_copy(
        update={
            "task": t.task.model_copy(update={"name": "paper-task", "version": 1}),
            "baseline": baseline,
            "budget": budget,
            "provenance": provenance,
            "metrics": t.metrics.model_copy(update={"final": final}),
            "privacy": None if privacy is None else PrivacyClaim.model_validate(privacy),
        }
    )


def run_row(baseline, budget, wer, version=3, overrides=None, speakers=None, dev=None):
    """speakers: per-speaker (errors, words) on cv-test; the WER is then theirs. dev: (cv-dev,
    ls-dev) WERs, dev sets on the test set's corpus and on another one."""
    t = _template("run")
    test = next(r for r in t.metrics.final.values() if r.role == "test")
    if speakers is not None:
        wer = sum(e for e, _ in speakers.values()) / sum(n for _, n in speakers.values())
    final = {"cv-test": test.model_copy(update={"wer": wer, "speakers": speakers})}
    task = {**t.config["task"], "eval_sets": [
        {"name": "cv-test", "corpus": "commonvoice", "role": "test"},
        {"name": "cv-dev", "corpus": "commonvoice", "role": "dev"},
        {"name": "ls-dev", "corpus": "librispeech", "role": "dev"}]}  # fmt: skip
    if dev is not None:
        for name, value in zip(["cv-dev", "ls-dev"], dev, strict=True):
            final[name] = test.model_copy(update={"role": "dev", "wer": value, "speakers": None})
    recipe = copy.deepcopy(t.config["recipe"])
    recipe["federated"]["cohort_size"] = 16
    for key, typed in (overrides or {}).items():  # the recipe holds what --set set
        *parents, last = key.split(".")
        node = recipe
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(typed)
    return t.model_copy(
        update={
            "task": t.task.model_copy(update={"name": "embedded", "version": version}),
            "baseline": baseline,
            "budget": budget,
            "config": {**t.config, "task": task, "recipe": recipe, "overrides": overrides or {}},
            "metrics": t.metrics.model_copy(update={"final": final}),
        }
    )


def records():
    return [
        paper_row("seed-only", "none", 0.61),
        paper_row("global", "eps7.2-high-pop", 0.31),
        paper_row("perlayer-dim", "eps7.2-high-pop", 0.20, table="Table 17", also=["Table 1"]),
        paper_row("perlayer-uniform", "none", 0.19),
        # the same configuration at another clip bound: more overrides, left out
        paper_row("perlayer-uniform", "none", 0.10, overrides={"privacy.clip_bound": "1.0"}),
        paper_row("fedavg", "none", 0.29, table="Table 4"),  # not Table 1: left out
        run_row("seed-only", "none", 0.70),
        run_row("seed-only", "none", 0.72),
        run_row("global", "eps7.2-m", 0.50),
        run_row("perlayer-dim", "eps7.2-m", 0.44),  # swapped with perlayer-uniform/none
        run_row("perlayer-uniform", "none", 0.46),
        run_row("perlayer-uniform", "none", 0.40),
        # left out: a --set variant, an older task version, an undeclared DP budget, another cohort
        run_row("global", "eps7.2-m", 0.01, overrides={"federated.local_steps": "3"}),
        run_row("global", "eps7.2-m", 0.01, version=2),
        run_row("global", "eps7.2-other", 0.01),
        run_row("global", "eps7.2-m", 0.01, overrides={"federated.cohort_size": "32"}),
    ]


def report(recs, spec=TABLE_1):
    return table_report(recs, "embedded", spec, BUDGETS, ["eps7.2-m"], 3)


def test_validity_report_on_hand_made_records_with_a_known_tau():
    result = report(records())
    assert result.common == [
        ("global", "eps7.2-high-pop", None),
        ("perlayer-dim", "eps7.2-high-pop", None),  # cited by Table 1 through `also`
        ("perlayer-uniform", "none", None),
        ("seed-only", "none", None),
    ]
    assert result.paper_wer[("perlayer-uniform", "none", None)] == 0.19  # fewest overrides
    assert [r.provenance.overrides for r, _ in result.left_out] == [{"privacy.clip_bound": "1.0"}]
    assert result.embedded_wer[("seed-only", "none", None)] == pytest.approx(0.71)  # 2 seeds
    assert len(result.embedded_runs[("perlayer-uniform", "none", None)]) == 2
    # perlayer-uniform/none averages 0.43 < 0.44: the paper's order for that pair holds; all 6
    # pairs agree.
    assert result.tau == 1.0
    swapped = report(records() + [run_row("perlayer-uniform", "none", 0.50)])  # 0.4533 > 0.44
    assert swapped.tau == pytest.approx(4 / 6)
    assert [p.agreement for p in swapped.pairs].count("disagree") == 1
    disagreeing = next(p for p in swapped.pairs if p.agreement == "disagree")
    assert {disagreeing.first[0], disagreeing.second[0]} == {"perlayer-dim", "perlayer-uniform"}
    text = render_table_report(swapped)
    assert "Kendall τ-b = 0.667** over 4 configurations (6 pairs: 5 agree, 1" in text
    assert text.count("| disagree |") == 1 and text.count("| agree |") == 5
    assert (
        "| perlayer-dim | eps7.2-high-pop | default | eps7.2-m | 20.00 | 2 | 44.00 (1) | 1 |"
        in text
    )
    summary = render_validity([swapped])  # no per-speaker counts: noise cannot be judged
    assert (
        "| A fixture paper Table 1 | noise × clipping | paper-task | 4 | 6 | 5 | 1 | 0 | 0.667 |"
        in summary
    )


def test_absolute_cohorts_make_the_cohort_part_of_the_configuration():
    recs = [
        paper_row("fedavg", "none", 0.29, table="Table 16", cohort=8,
                  overrides={"federated.cohort_size": "8"}),
        paper_row("fedavg", "none", 0.26, table="Table 16", cohort=16,
                  overrides={"federated.cohort_size": "16"}),
        paper_row("fedavg", "none", 0.24, table="Table 16", cohort=32,
                  overrides={"federated.cohort_size": "32"}),
        run_row("fedavg", "none", 0.84, overrides={"federated.cohort_size": "8"}),
        run_row("fedavg", "none", 0.82),  # the task's own cohort, 16
        run_row("fedavg", "none", 0.80, overrides={"federated.cohort_size": "32"}),
    ]  # fmt: skip
    result = report(recs, COHORTS)
    assert result.common == [("fedavg", "none", 8), ("fedavg", "none", 16), ("fedavg", "none", 32)]
    assert result.tau == 1.0
    assert report(recs, TABLE_1).common == []  # with default cohorts, cohort variants are out


def test_a_disagreement_within_noise_is_marked():
    """Runs scored on the same speakers: a 1-point difference made of per-speaker differences
    of +12 and -10 points cannot be resolved ('within noise'); a 40-point one is."""

    def counts(errors, swing=0):
        return {f"s{i}": (errors + (i % 5) * 5 + (swing if i % 2 else -swing + 2 * (swing > 0)),
                          100) for i in range(20)}  # fmt: skip

    recs = [
        paper_row("global", "eps7.2-high-pop", 0.31),
        paper_row("perlayer-dim", "eps7.2-high-pop", 0.20),
        paper_row("seed-only", "none", 0.61),
        run_row("global", "eps7.2-m", None, speakers=counts(50)),
        run_row("perlayer-dim", "eps7.2-m", None, speakers=counts(50, swing=11)),
        run_row("seed-only", "none", None, speakers=counts(90)),
    ]
    assert recs[4].metrics.final["cv-test"].wer - recs[3].metrics.final["cv-test"].wer == (
        pytest.approx(0.01)
    )
    result = report(recs)
    pair = next(p for p in result.pairs if {p.first[0], p.second[0]} == {"global", "perlayer-dim"})
    assert pair.agreement == "disagree" and pair.resolved is False
    assert pair.embedded_interval.low < 0 < pair.embedded_interval.high
    resolved = [p for p in result.pairs if "seed-only" in (p.first[0], p.second[0])]
    assert all(p.agreement == "agree" and p.resolved for p in resolved)
    text = render_validity([result])
    assert "disagree (within noise)" in text and "| 1 (1 within noise) |" in text


def test_validity_needs_two_shared_configurations_and_says_what_is_missing():
    only_paper = [r for r in records() if r.kind == "reference"]
    result = report(only_paper)
    assert result.tau is None
    assert "Not enough configurations in common (0; need 2)" in render_table_report(result)


def test_reversing_the_embedded_ranking_gives_minus_one():
    paper = [r for r in records() if r.kind == "reference" and not r.provenance.overrides]
    paper = [r for r in paper if r.provenance.table != "Table 4"]
    budgets = {"seed-only": "none", "perlayer-uniform": "none"}
    runs = [run_row(r.baseline, budgets.get(r.baseline, "eps7.2-m"), 1 - r.metrics.final[
        "cv-test"].wer) for r in paper]  # fmt: skip
    result = report(paper + runs)
    assert len(result.common) == 4 and result.tau == -1.0
    assert all(p.agreement == "disagree" for p in result.pairs)
    assert len(list(itertools.combinations(result.common, 2))) == len(result.pairs)


SERVERS = PaperTable(PAPER, "Table 9", "paper-task", "server optimizer", "absolute",
                     tuned=("federated.server.lr",))  # fmt: skip


def test_a_tuned_hyperparameter_is_chosen_on_the_dev_split_never_the_test_split():
    """Where the paper tuned a key per configuration, the embedded setting with the lowest dev
    WER (on the test set's corpus: cv-dev, not ls-dev) stands for the configuration."""

    def lr(value):
        return {"federated.server.lr": value}

    recs = [
        paper_row("fedavg", "none", 0.22, table="Table 9", cohort=16),
        paper_row("server-adam", "none", 0.23, table="Table 9", cohort=16, overrides=lr("5e-4")),
        paper_row("server-sgd", "none", 0.25, table="Table 9", cohort=16, overrides=lr("3.0")),
        run_row("fedavg", "none", 0.50, dev=(0.46, 0.30)),
        run_row("server-sgd", "none", 0.60, dev=(0.58, 0.20)),
        run_row("server-adam", "none", 0.75, dev=(0.73, 0.70)),  # the baseline's lr
        # the best test WER, but not the best cv-dev: never chosen
        run_row("server-adam", "none", 0.45, overrides=lr("0.002"), dev=(0.56, 0.10)),
        # chosen on cv-dev (mean of its two seeds, 0.52), although its ls-dev is the worst
        run_row("server-adam", "none", 0.54, overrides=lr("0.0006"), dev=(0.51, 0.90)),
        # (another spelling of the same lr: the same setting)
        run_row("server-adam", "none", 0.56, overrides=lr("6.0e-4"), dev=(0.53, 0.90)),
        # a key the table does not tune: left out
        run_row("server-adam", "none", 0.01, overrides={"federated.client.lr": "9"}, dev=(0, 0)),
    ]
    result = report(recs, SERVERS)
    adam = ("server-adam", "none", 16)
    assert result.common == [("fedavg", "none", 16), adam, ("server-sgd", "none", 16)]
    assert result.embedded_wer[adam] == pytest.approx(0.55)  # the 0.0006 runs' test WER
    settings = result.tuning[adam]
    assert [s.describe() for s in settings] == [
        "federated.server.lr=0.0006",
        "federated.server.lr=0.002",
        "as specified (no --set)",
    ]
    assert [s.dev_wer for s in settings] == pytest.approx([0.52, 0.56, 0.73])
    assert len(result.embedded_runs[adam]) == 2
    assert ("fedavg", "none", 16) not in result.tuning  # one setting: nothing was tuned
    # paper order fedavg < adam < sgd; embedded 0.50 < 0.55 < 0.60: all agree
    assert result.tau == 1.0
    text = render_table_report(result)
    assert "Tuned on the dev split (federated.server.lr;" in text
    chosen = "| server-adam/none/S=16 | federated.server.lr=0.0006 | 52.00 | 55.00 (2) | chosen |"
    assert chosen in text
    assert "| server-adam/none/S=16 | as specified (no --set) | 73.00 | 75.00 (1) |  |" in text
    # a table that tunes nothing keeps only the runs without such overrides
    untuned = report(recs, COHORTS)
    assert untuned.embedded_wer[adam] == pytest.approx(0.75) and not untuned.tuning


def test_cli_validity_of_the_repository_reports_the_tuned_settings():
    """`pflbench validity --json` on the filed records: each Table 9 configuration run at
    several server lrs lists them, the chosen one (the lowest dev WER) first."""
    args = ["validity", "--task", "synth-cv-en-ls-seed", "--table", "002 Table 9"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    (table,) = json.loads(result.output)
    tuned = {c["baseline"]: c["tuned_on_dev"] for c in table["configurations"] if c["tuned_on_dev"]}
    if matrix_being_filed():
        pytest.skip("the task's current version is still filing its matrix (sweeps/to-run/)")
    assert {"server-adam", "server-adagrad", "server-lars", "server-sgd"} <= set(tuned)
    for settings in tuned.values():
        dev = [s["dev_wer"] for s in settings]
        assert dev[0] == min(dev) and len(dev) >= 3
    markdown = CliRunner().invoke(app, args)
    assert markdown.exit_code == 0 and "Tuned on the dev split" in markdown.output


def matrix_being_filed() -> bool:
    """Whether the embedded task's current version is still filing its matrix (sweeps/to-run/):
    its server-lr rows, and the baselines' rows they are tuned against, may not all be filed."""
    return (Path(__file__).parents[1] / "sweeps" / "to-run").is_dir()
