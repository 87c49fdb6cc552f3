"""Signal-to-noise matched budgets: same ε, δ, q, T as the paper budget; σ_DP·√d equal."""

import json
import math

import pytest
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.privacy.matching import (
    PAPER_PRESET,
    PAPER_RUN_COHORT,
    match_report,
    matched_scale,
    model_parameters,
    noise_to_clip_ratio,
    noise_to_sampling_ratio,
)
from pflbench.privacy.statement import budget_noise
from pflbench.spec.models import Budget
from pflbench.spec.registry import load_registry


@pytest.fixture(scope="module")
def registry():
    return load_registry()


# The budgets matched for synth-cpu (task v4, synth-cv-en-scratch) and synth-cpu-m (task v5).
MATCHED = [
    ("eps7.2-synth-matched", "synth-cpu"),
    ("eps4.5-synth-matched", "synth-cpu"),
    ("eps7.2-synth-m-matched", "synth-cpu-m"),
    ("eps4.5-synth-m-matched", "synth-cpu-m"),
]


@pytest.mark.parametrize("name, preset", MATCHED)
def test_shipped_matched_budgets_match_the_paper_noise_to_clip_ratio(registry, name, preset):
    budget = registry.budget(name).spec
    paper = registry.budget(budget.matches).spec
    assert budget.matched_parameters == model_parameters(preset)
    # Same guarantee shape: ε, δ, T and (to rounding of the cohort) q; hence the same z.
    assert (budget.epsilon, budget.delta, budget.steps) == (paper.epsilon, paper.delta, paper.steps)
    assert budget.cohort / budget.population == pytest.approx(
        paper.cohort / paper.population, rel=1e-4
    )
    ours, theirs = budget_noise(budget), budget_noise(paper)
    assert ours["noise_multiplier"] == pytest.approx(theirs["noise_multiplier"], rel=1e-3)
    report = match_report(budget, paper, model_parameters(PAPER_PRESET))
    assert abs(report["relative_difference"]) < 1e-3
    # ... and the match is not trivially true: the paper budget itself is sqrt(d_paper / d)
    # times weaker here (~15x for synth-cpu, ~7x for synth-cpu-m).
    weak = noise_to_clip_ratio(theirs["sigma_dp"], budget.matched_parameters)
    d_ratio = model_parameters(PAPER_PRESET) / budget.matched_parameters
    assert report["noise_to_clip_ratio"] / weak == pytest.approx(math.sqrt(d_ratio), rel=1e-2)
    assert d_ratio > 40
    assert matched_scale(paper, budget.matched_parameters, model_parameters(PAPER_PRESET)) == {
        "epsilon": budget.epsilon,
        "delta": budget.delta,
        "population": budget.population,
        "cohort": budget.cohort,
        "steps": budget.steps,
        "matches": paper.name,
        "matched_parameters": budget.matched_parameters,
    }


@pytest.mark.parametrize("name, preset", MATCHED)
def test_cohort_matched_budgets_keep_the_paper_dp_to_sampling_noise_ratio(registry, name, preset):
    name = name.replace("-matched", "-cohort-matched")
    budget = registry.budget(name).spec
    paper = registry.budget(budget.matches).spec
    assert budget.matched_parameters == model_parameters(preset)
    synth_task = registry.task("synth-cv-en-ls-seed").spec
    assert budget.matched_cohort == synth_task.recipe.federated.cohort_size
    d, d_paper = budget.matched_parameters, model_parameters(PAPER_PRESET)
    report = match_report(budget, paper, d_paper)
    assert abs(report["relative_difference"]) < 2e-3
    ours, theirs = budget_noise(budget)["sigma_dp"], budget_noise(paper)["sigma_dp"]
    assert noise_to_sampling_ratio(ours, d, budget.matched_cohort) == pytest.approx(
        noise_to_sampling_ratio(theirs, d_paper, PAPER_RUN_COHORT), rel=2e-3
    )
    # sqrt(1024 / 16) = 8 times the noise of the sigma*sqrt(d)-matched budget
    plain = registry.budget(name.replace("-cohort", "")).spec
    assert ours / budget_noise(plain)["sigma_dp"] == pytest.approx(8.0, rel=2e-3)
    assert matched_scale(paper, d, d_paper, budget.matched_cohort)["cohort"] == budget.cohort


def test_matching_a_model_of_the_paper_size_returns_the_paper_scale(registry):
    paper = registry.budget("eps7.2-high-pop").spec
    d = model_parameters(PAPER_PRESET)
    scale = matched_scale(paper, d, d)
    assert (scale["cohort"], scale["population"]) == (paper.cohort, paper.population)
    assert noise_to_clip_ratio(3e-6, 4 * d) == pytest.approx(2 * noise_to_clip_ratio(3e-6, d))
    with pytest.raises(UserError, match="no noise"):
        matched_scale(registry.budget("none").spec, d, d)


def test_budget_needs_both_matching_fields():
    fields = dict(name="x", epsilon=1.0, delta=1e-9, population=10, cohort=2, steps=3)
    with pytest.raises(ValueError, match="both matches and matched_parameters"):
        Budget(**fields, matches="eps7.2-high-pop")


def test_budgets_show_and_match_cli():
    runner = CliRunner()
    out = runner.invoke(app, ["budgets", "show", "eps7.2-synth-matched", "--json"])
    assert out.exit_code == 0, out.output
    shown = json.loads(out.output)
    assert shown["matching"]["matches"] == "eps7.2-high-pop"
    assert math.isclose(shown["matching"]["noise_to_clip_ratio"], 0.048, rel_tol=0.01)
    out = runner.invoke(
        app, ["budgets", "match", "eps4.5-low-pop", "--preset", "synth-cpu", "--json"]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["cohort"] == 13363
    out = runner.invoke(app, ["budgets", "match", "none", "--preset", "synth-cpu"])
    assert isinstance(out.exception, UserError) and "not a DP budget" in str(out.exception)
