"""The one-shot canary audit (privacy/audit.py): its statistics, the mechanism it audits (the real
StepAggregator over many steps, with test-only faults injected), and `pflbench run` end to end."""

import copy
import json
import math

import numpy as np
import pytest
import torch
import yaml
from conftest import make_mechanism
from scipy import stats
from test_results_plots import assert_image
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.cli.run import run_summary
from pflbench.errors import UserError
from pflbench.fl.aggregate import StepAggregator
from pflbench.privacy.accountants import ACCOUNTANTS, compute_epsilon
from pflbench.privacy.accounting import SampledGaussian
from pflbench.privacy.audit import (
    CanaryAudit,
    canary_update,
    check_audit,
    check_audit_claim,
    clopper_pearson_upper,
    epsilon_lower_bound,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
)
from pflbench.privacy.clipping import clip_update, layer_bounds
from pflbench.privacy.noise import server_noise_std
from pflbench.privacy.statement import epsilons_at_scale
from pflbench.results.leaderboard import render_leaderboard
from pflbench.results.plots import plot_results
from pflbench.results.schema import load_record
from pflbench.results.submit import submit
from pflbench.runner import RunOptions, run
from pflbench.seeds import keyed_generator
from pflbench.spec.models import Recipe, RunConfig
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import config_hash, resolve

DELTA = 1e-5


# ----------------------------------------------------------------------------------------------
# μ-GDP


def test_gdp_delta_at_epsilon_zero_is_the_total_variation_of_two_unit_gaussians():
    # Fault caught: a sign or factor error in δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2).
    for mu in (0.3, 1.0, 3.0):
        assert gdp_delta(mu, 0.0) == pytest.approx(2 * stats.norm.cdf(mu / 2) - 1, rel=1e-12)
    assert gdp_delta(1.0, 1.0) == pytest.approx(
        stats.norm.cdf(-0.5) - math.e * stats.norm.cdf(-1.5), rel=1e-12
    )


@pytest.mark.parametrize(("z", "steps"), [(1.0, 1), (2.0, 4), (0.7, 1), (5.0, 100)])
def test_gdp_epsilon_equals_the_pld_accountant_for_the_composed_gaussian_mechanism(z, steps):
    # T unsampled Gaussian mechanisms of noise multiplier z are exactly (√T/z)-GDP; dp_accounting's
    # PLD is tight for them. Fault caught: a wrong μ-GDP → (ε, δ) conversion.
    pld = compute_epsilon(SampledGaussian(z, 1.0, steps), DELTA, "pld").epsilon
    assert gdp_epsilon(math.sqrt(steps) / z, DELTA) == pytest.approx(pld, rel=1e-4)


def test_gdp_epsilon_inverts_delta_and_grows_with_mu():
    for mu in (0.1, 0.8, 2.0, 6.0, 40.0):
        for eps in (0.0, 0.5, 3.0):
            delta = gdp_delta(mu, eps)
            if 1e-12 < delta < 1:
                assert gdp_epsilon(mu, delta) == pytest.approx(eps, abs=1e-6)
    epsilons = [gdp_epsilon(mu, 1e-9) for mu in (0.0, 0.5, 1.0, 2.0, 8.0, 50.0)]
    assert epsilons[0] == 0.0 and all(a < b for a, b in zip(epsilons, epsilons[1:], strict=False))
    assert gdp_epsilon(math.inf, 1e-9) == math.inf


# ----------------------------------------------------------------------------------------------
# Canaries


LIKE = {"w": torch.zeros(30, 40), "b": torch.zeros(40), "v": torch.zeros(500)}


@pytest.mark.parametrize("mode", ["dim", "uniform"])
def test_a_perlayer_canary_meets_every_layer_bound_exactly(mode):
    # Fault caught: a canary scaled only globally would be clipped per layer (so not "clipped
    # like any user") or exceed the sensitivity the accountant assumes.
    canary = canary_update(3, 0, LIKE, 0.5, perlayer=True, perlayer_mode=mode)
    bounds = layer_bounds([t.numel() for t in LIKE.values()], 0.5, mode)
    norms = torch.stack([t.norm(dtype=torch.float64) for t in canary.values()])
    assert torch.allclose(norms, bounds, rtol=1e-6)
    clipped = clip_update({k: v.clone() for k, v in canary.items()}, "perlayer", 0.5, mode)
    assert all(torch.allclose(clipped.update[k], canary[k], rtol=1e-6) for k in canary)


def test_canaries_are_seeded_unit_directions_scaled_to_the_clip_bound():
    one = canary_update(7, 1, LIKE, 2.0, perlayer=False)
    again = canary_update(7, 1, LIKE, 2.0, perlayer=False)
    other = canary_update(8, 1, LIKE, 2.0, perlayer=False)
    other_seed = canary_update(7, 2, LIKE, 2.0, perlayer=False)
    flat = [torch.cat([t.flatten() for t in c.values()]) for c in (one, again, other, other_seed)]
    assert float(flat[0].norm()) == pytest.approx(2.0, rel=1e-6)
    assert torch.equal(flat[0], flat[1])
    d = flat[0].numel()
    for f in flat[2:]:  # independent random directions: cosine ~ N(0, 1/d)
        assert abs(float(flat[0] @ f) / 4.0) < 5 / math.sqrt(d)


def test_only_an_audited_config_hashes_differently():
    # Fault caught: the new field changing the hash of every run made before it existed.
    registry = load_registry()
    plain = resolve(registry, "synth-cv-en-ls-seed", "perlayer-dim", "none", 0, [])
    zero = resolve(
        registry, "synth-cv-en-ls-seed", "perlayer-dim", "none", 0, ["privacy.audit_canaries=0"]
    )
    audited = resolve(
        registry, "synth-cv-en-ls-seed", "perlayer-dim", "none", 0, ["privacy.audit_canaries=5"]
    )
    assert "audit_canaries" not in plain.model_dump(mode="json")["recipe"]["privacy"]
    assert zero.recipe.model_dump(mode="json") == plain.recipe.model_dump(mode="json")
    assert config_hash(plain) != config_hash(audited)
    assert audited.model_dump(mode="json")["recipe"]["privacy"]["audit_canaries"] == 5
    stored = plain.model_dump(mode="json")
    assert config_hash(RunConfig.model_validate(stored)) == config_hash(plain)


def test_a_canary_is_folded_in_at_the_step_s_clip_bound():
    # Adaptive clipping moves the bound from step to step; a canary follows it (Fault caught: a
    # canary at the recipe's C would be clipped, or stand out, once the bound has moved).
    recipe = Recipe.model_validate({"privacy": {"audit_canaries": 1, "clip_bound": 1.0}})
    audit = CanaryAudit(recipe, 0, LIKE, [])
    mechanism = make_mechanism(recipe.privacy, 1, clip_bound=0.3)
    aggregator = StepAggregator(LIKE, mechanism, 0, 10.0)
    assert audit.fold_in(aggregator, [audit.ids[0], "someone"]) == ["someone"]
    grads, report = aggregator.finish()
    assert float(torch.cat([g.flatten() for g in grads]).norm()) == pytest.approx(0.3, rel=1e-5)
    assert report["clients"] == 0  # a canary is no client of the training stats


def test_an_audit_needs_federated_training_and_clipping():
    for fields in (
        {"training": "central", "privacy": {"audit_canaries": 5}},
        {"privacy": {"clipping": "none", "audit_canaries": 5}},
    ):
        recipe = Recipe.model_validate(fields)
        with pytest.raises(UserError, match="audit_canaries"):
            check_audit(recipe)
    recipe = Recipe.model_validate({"privacy": {"audit_canaries": 2}})
    with pytest.raises(UserError, match="clash"):
        CanaryAudit(recipe, 0, LIKE, ["audit-canary-000001"])


# ----------------------------------------------------------------------------------------------
# Estimates on synthetic cosines


def gaussian_cosines(mu: float, n: int, dim: int = 10_000, seed: int = 0):
    rng = np.random.default_rng(seed)
    scale = 1 / math.sqrt(dim)
    return rng.normal(mu * scale, scale, n), rng.normal(0.0, scale, n)


@pytest.mark.parametrize("mu", [0.0, 0.5, 1.0, 2.0, 4.0])
def test_the_estimator_recovers_mu_from_gaussian_cosines(mu):
    # Fault caught: standardizing by the wrong spread (e.g. the std of the mean, or 1/d).
    inserted, held_out = gaussian_cosines(mu, 2000, seed=int(10 * mu))
    assert gdp_mu(inserted, held_out) == pytest.approx(mu, abs=0.08 + 0.04 * mu)


def test_clopper_pearson_upper_bound_closed_forms_and_coverage():
    # Fault caught: a two-sided level, or the lower bound, in place of the one-sided upper one.
    alpha, n = 0.05, 40
    assert clopper_pearson_upper(np.array([0]), n, alpha)[0] == pytest.approx(1 - alpha ** (1 / n))
    assert clopper_pearson_upper(np.array([n]), n, alpha)[0] == 1.0
    # The bound is the p at which seeing k or fewer successes has probability exactly alpha.
    k = np.arange(n)
    assert np.allclose(stats.binom.cdf(k, n, clopper_pearson_upper(k, n, alpha)), alpha)
    rng = np.random.default_rng(0)
    for p in (0.05, 0.3, 0.7):
        successes = rng.binomial(n, p, size=4000)
        assert np.mean(clopper_pearson_upper(successes, n, alpha) >= p) >= 1 - alpha


@pytest.mark.parametrize("mu", [0.0, 1.0, 2.0, 4.0])
def test_the_lower_bound_stays_below_the_estimate(mu):
    inserted, held_out = gaussian_cosines(mu, 500, seed=1 + int(mu))
    bound = epsilon_lower_bound(inserted, held_out, DELTA, 0.95)
    assert 0.0 <= bound <= gdp_epsilon(gdp_mu(inserted, held_out), DELTA)
    if mu == 0.0:
        assert bound == 0.0


def test_the_lower_bound_of_separated_cosines_is_the_bonferroni_clopper_pearson_limit():
    # With no overlap the best test is perfect; the bound is then set by the counts alone.
    # Fault caught: dropping the Bonferroni correction over the thresholds tried.
    n, confidence = 200, 0.95
    inserted, held_out = np.linspace(1.0, 2.0, n), np.linspace(-1.0, 0.0, n)
    upper = 1 - ((1 - confidence) / (2 * n)) ** (1 / n)
    expected = math.log((1 - DELTA - upper) / upper)
    assert epsilon_lower_bound(inserted, held_out, DELTA, confidence) == pytest.approx(expected)


# ----------------------------------------------------------------------------------------------
# The mechanism: the real aggregator (clipping, keyed noise, exact sum) over many steps


REAL_USERS, CANARIES, STEPS = 20, 120, 8


def audit_aggregator(
    sigma_dp: float, sampling_rate: float, sampling: str = "poisson", placement: str = "server"
) -> dict:
    """Audit T steps of the real StepAggregator: real users send random updates (larger than the
    bound, so they are clipped), canaries are sampled among them; the server applies SGD (lr 1),
    so θ_0 − θ_T is the sum of the noisy averages."""
    population = REAL_USERS + CANARIES
    cohort = round(sampling_rate * population)
    recipe = Recipe.model_validate(
        {
            "federated": {"cohort_size": cohort, "central_steps": STEPS, "sampling": sampling},
            "privacy": {
                "clipping": "perlayer",
                "clip_bound": 1.0,
                "noise_placement": placement,
                "audit_canaries": CANARIES,
            },
        }
    )
    params = {"w": torch.zeros(40, 50), "b": torch.zeros(2000)}
    users = [f"user{i}" for i in range(REAL_USERS)]
    audit = CanaryAudit(recipe, 0, params, users)
    everyone = users + audit.ids
    mechanism = make_mechanism(recipe.privacy, everyone, sigma_dp, cohort, sampling)
    for step in range(STEPS):
        aggregator = StepAggregator(params, mechanism, step, 100.0)
        sampled = mechanism.cohort(step).tolist()
        for user in audit.fold_in(aggregator, [everyone[i] for i in sampled]):
            generator = keyed_generator(user, step)
            update = {k: torch.randn(p.shape, generator=generator) for k, p in params.items()}
            aggregator.add(update, user, 0.0, 1, 1)
        grads, _ = aggregator.finish()
        torch._foreach_sub_(list(params.values()), grads)
    scale = epsilons_at_scale(sigma_dp, cohort, population, STEPS, DELTA, ("rdp", "pld"))
    return audit.finish(params, mechanism.cohort, STEPS, scale)


NOISE_MULTIPLIER = 1.2  # at q = 0.5 and T = 8: ε ≈ 8 (RDP), 7.2 (PLD) at δ = 1e-5


def sigma_for(sampling_rate: float) -> float:
    return NOISE_MULTIPLIER / round(sampling_rate * (REAL_USERS + CANARIES))


def test_audit_of_the_correct_mechanism_stays_below_the_accountants():
    # The one-run estimate cannot see past the Gaussian it fits: it stays under the accountants'
    # ε, which bound the mechanism (Fault caught: noise or sensitivity weaker than accounted).
    audit = audit_aggregator(sigma_for(0.5), 0.5)
    accountant = min(audit["accountant_epsilon_simulated"].values())  # PLD: the tighter one
    assert 6.0 < accountant < 8.0
    assert 1.0 < audit["epsilon_estimate"] < accountant
    assert audit["epsilon_lower_bound"] < audit["epsilon_estimate"]
    assert audit["canaries_sampled"] == CANARIES  # q = 0.5 over 10 steps: all but ~0.1%


def test_canaries_take_client_side_noise_and_count_in_fixed_cohorts():
    # Client-side noise needs exactly S users per step: canaries are among them (Fault caught: a
    # canary not counted fails the step; a canary skipping its noise shows as a huge ε).
    audit = audit_aggregator(sigma_for(0.5), 0.5, sampling="fixed", placement="client")
    assert 1.0 < audit["epsilon_estimate"] < min(audit["accountant_epsilon_simulated"].values())


def test_audit_of_a_broken_noise_exceeds_the_accountants(monkeypatch):
    # Test-only fault injection: the server adds 1/100 of the noise the accountant assumes.
    monkeypatch.setattr(
        "pflbench.privacy.steps.server_noise_std", lambda c, s: server_noise_std(c, s) / 100
    )
    audit = audit_aggregator(sigma_for(0.5), 0.5)
    accountant = max(audit["accountant_epsilon_simulated"].values())
    assert audit["epsilon_estimate"] > 2 * accountant
    assert audit["epsilon_lower_bound"] > 2.0


def test_audit_without_noise_reports_a_very_large_epsilon():
    # σ_DP = 0 with clipping on: every canary is in every step (q = 1), nothing hides it.
    audit = audit_aggregator(0.0, 1.0)
    assert audit["accountant_epsilon_simulated"] == {"rdp": None, "pld": None}
    assert audit["mu"] > 5 and audit["epsilon_estimate"] > 25
    assert audit["canary_participations"] == CANARIES * STEPS


# ----------------------------------------------------------------------------------------------
# `pflbench run` end to end on the tiny task


TASK = "synth-tiny-test"
RUN_CANARIES = 60
RUN_STEPS = 2
RECIPE = {
    "model": {"preset": "tiny"},
    "central": {"optimizer": "adam", "lr": 0.002, "steps": 5, "batch_seconds": 20.0},
    "federated": {
        "central_steps": RUN_STEPS,
        "cohort_size": 10_000,  # q = 1: every user and canary in every step
        "client": {"local_steps": 1, "batch_seconds": 10.0},
        "eval_every": 100,
    },
    "privacy": {"audit_canaries": RUN_CANARIES},
}


@pytest.fixture(scope="module")
def audit_specs(tmp_path_factory, tiny_task, tiny_task_data):
    """The tiny task, and a budget whose extrapolated scale is the simulated one (population
    including the canaries), so the accountant's ε at the simulated scale is its target."""
    root = tmp_path_factory.mktemp("audit-specs")
    (root / "tasks").mkdir()
    task = tiny_task.model_dump(mode="json", exclude_none=True) | {"recipe": RECIPE}
    (root / "tasks" / f"{TASK}.yaml").write_text(yaml.safe_dump(task))
    population = len(tiny_task_data.federated_train.users()) + RUN_CANARIES
    budget = {
        "name": "audit-eps8",
        "epsilon": 8.0,
        "delta": DELTA,
        "population": population,
        "cohort": population,
        "steps": RUN_STEPS,
    }
    (root / "tasks" / "budgets.yaml").write_text(yaml.safe_dump({"budgets": [budget]}))
    return root, population


@pytest.fixture
def audited_run(monkeypatch, tmp_path, tiny_cache_dir, audit_specs):
    monkeypatch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
    specs, _ = audit_specs

    def go(budget: str):
        config = resolve(load_registry([specs]), TASK, "perlayer-dim", budget, 0, [])
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        record, _ = load_record(
            run(config, out_dir=out, options=RunOptions(progress=False)) / "record.json"
        )
        return record, out

    return go


def test_an_audited_run_without_noise_records_a_very_large_epsilon(
    audited_run, audit_specs, tmp_path
):
    record, run_dir = audited_run("none")
    audit = record.privacy.audit
    assert audit.canaries_inserted == audit.canaries_held_out == RUN_CANARIES
    assert audit.canary_participations == RUN_CANARIES * RUN_STEPS  # sampled like users (q = 1)
    assert audit.epsilon_estimate > 50 and audit.epsilon_lower_bound > 1.5
    assert audit.accountant_epsilon_simulated == dict.fromkeys(ACCOUNTANTS)
    # Canaries are users of the accounted population, never of the evaluation.
    assert record.privacy.simulated.population == audit_specs[1]
    assert set(record.metrics.final) == {"cv-dev", "cv-test", "ls-dev-clean"}
    assert record.config["recipe"]["privacy"]["audit_canaries"] == RUN_CANARIES
    # Not ranked: the leaderboard lists it under "privacy audit" only.
    text = render_leaderboard([record])
    assert "### privacy audit" in text and "### budget" not in text
    assert f"| perlayer-dim | none | {RUN_CANARIES} + {RUN_CANARIES} | ∞ |" in text
    summary = run_summary(run_dir)  # what `pflbench run` prints at the end
    assert any(line.startswith(f"privacy audit ({RUN_CANARIES} canaries") for line in summary)
    # `pflbench submit` accepts it, and rechecks the audit's numbers against its own summary.
    registry = load_registry([audit_specs[0]])
    submit(run_dir, tmp_path / "results", registry)
    raw = json.loads((run_dir / "record.json").read_text())
    check_audit_claim(raw["privacy"], RUN_CANARIES, "record")
    with pytest.raises(UserError, match="canaries_inserted"):
        check_audit_claim(raw["privacy"], RUN_CANARIES + 1, "record")
    raw["privacy"]["audit"]["epsilon_estimate"] /= 10
    with pytest.raises(UserError, match="epsilon_estimate"):
        check_audit_claim(raw["privacy"], RUN_CANARIES, "record")
    raw["privacy"]["audit"]["epsilon_estimate"] *= 10
    # What the lower bound rests on is pflbench's, not the record's to choose.
    for key, value in [("canaries_held_out", 5000), ("confidence", 0.999),
                       ("lower_bound_method", "my own")]:  # fmt: skip
        tampered = copy.deepcopy(raw["privacy"])
        tampered["audit"][key] = value
        with pytest.raises(UserError, match=f"privacy.audit.{key} is"):
            check_audit_claim(tampered, RUN_CANARIES, "record")
    # The summary and the lower bound follow from the record's own per-canary cosines.
    assert len(raw["privacy"]["audit"]["canary_cosines"]["inserted"]) == RUN_CANARIES
    for key, change in [("epsilon_lower_bound", 0.0), ("cosines", "inserted_mean")]:
        tampered = copy.deepcopy(raw["privacy"])
        if key == "cosines":
            tampered["audit"]["cosines"][change] += 0.01
        else:
            tampered["audit"][key] = change
        with pytest.raises(UserError, match=rf"privacy.audit.{key}\S* is .* canary_cosines give"):
            check_audit_claim(tampered, RUN_CANARIES, "record")
    tampered = copy.deepcopy(raw["privacy"])
    del tampered["audit"]["canary_cosines"]  # then the lower bound would go unchecked
    with pytest.raises(UserError, match="privacy.audit.canary_cosines is missing"):
        check_audit_claim(tampered, RUN_CANARIES, "record")
    check_audit_claim(tampered, RUN_CANARIES, "record", per_canary=False)  # a stale record's
    tampered = copy.deepcopy(raw["privacy"])
    tampered["audit"]["canary_cosines"]["held_out"].pop()
    with pytest.raises(
        UserError,
        match=f"canary_cosines holds {RUN_CANARIES} inserted and {RUN_CANARIES - 1} held-out",
    ):
        check_audit_claim(tampered, RUN_CANARIES, "record")
    raw["privacy"]["audit"] = None
    with pytest.raises(UserError, match="privacy.audit is missing"):
        check_audit_claim(raw["privacy"], RUN_CANARIES, "record")


def test_an_audited_run_with_the_correct_noise_stays_below_its_accountant(audited_run, tmp_path):
    record, _ = audited_run("audit-eps8")
    audit = record.privacy.audit
    accountants = audit.accountant_epsilon_simulated
    assert accountants["rdp"] == pytest.approx(8.0, rel=1e-3) and accountants["pld"] < 8.0
    assert 0 < audit.epsilon_estimate < accountants["pld"]  # below even the tighter accountant
    # (The broken-noise fault is injected in test_audit_of_a_broken_noise_exceeds_the_accountants.)
    # `pflbench plot` draws audit ε against the accountant's, and no WER figure from it.
    report = plot_results([record], tmp_path / "plots")
    assert [p.name for p in report.written] == [f"{TASK}-privacy-audit.png"]
    assert_image(report.written[0], size=None)


def test_the_cli_flag_sets_the_recipe_field_and_refuses_unclipped_baselines():
    args = ["run", "--task", "synth-cv-en-ls-seed", "--baseline", "fedavg", "--budget", "none"]
    result = CliRunner().invoke(app, [*args, "--audit-canaries", "10"])
    assert isinstance(result.exception, UserError)  # `pflbench` prints it, exit code 2
    assert "privacy.audit_canaries needs clipped updates" in str(result.exception)
