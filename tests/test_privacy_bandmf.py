"""BandMF DP-FTRL (privacy/mechanisms/bandmf.py, accounting.BandMF): the strategy matrix, the
sensitivity against brute force, the correlated noise's covariance, exact resume mid-band, the
participation schema, ε through the equivalent sampled Gaussian, and submit's re-accounting."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from conftest import make_mechanism

from pflbench.checkpoint import load_checkpoint, save_checkpoint
from pflbench.errors import UserError
from pflbench.fl.aggregate import StepAggregator
from pflbench.privacy.accountants import compute_epsilon
from pflbench.privacy.accounting import BandMF, SampledGaussian
from pflbench.privacy.mechanisms import check_mechanism_recipe
from pflbench.privacy.mechanisms.bandmf import BandMF as BandMFMechanism
from pflbench.privacy.mechanisms.bandmf import (
    column_norms,
    participation_sensitivity,
    strategy_matrix,
)
from pflbench.privacy.run import privacy_claim, run_sigma_dp
from pflbench.privacy.statement import budget_noise
from pflbench.results.submit import check_record_privacy
from pflbench.spec.models import Budget, PrivacyRecipe, Recipe
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import resolve

DELTA = 1e-9


def bandmf(bands: int, **privacy) -> PrivacyRecipe:
    fields = {"clipping": "global", "clip_bound": 1.0} | privacy
    return PrivacyRecipe(mechanism="bandmf", mechanism_options={"bands": bands}, **fields)


# ----------------------------------------------------------------------------------------------
# The strategy matrix and its sensitivity


def test_the_strategy_is_the_banded_square_root_of_the_prefix_sum_matrix():
    steps = 12
    full = strategy_matrix(steps, steps)
    np.testing.assert_allclose(full @ full, np.tril(np.ones((steps, steps))), atol=1e-12)
    banded = strategy_matrix(4, steps)
    rows, cols = np.indices(banded.shape)
    np.testing.assert_array_equal(banded, np.where(rows - cols < 4, full, 0.0))
    np.testing.assert_allclose(column_norms(4, steps), np.linalg.norm(banded, axis=0), rtol=1e-14)


def brute_force_sensitivity(matrix: np.ndarray, separation: int) -> float:
    """max over every pattern of steps at least `separation` apart and every sign vector on it of
    ‖C u‖ (the maximum over |u_j| <= 1 of a convex function is at a vertex)."""
    steps, best = matrix.shape[1], 0.0
    for size in range(1, steps + 1):
        for pattern in itertools.combinations(range(steps), size):
            if any(b - a < separation for a, b in itertools.pairwise(pattern)):
                continue
            for signs in itertools.product((1.0, -1.0), repeat=size - 1):
                u = np.zeros(steps)
                u[list(pattern)] = (1.0, *signs)  # -u gives the same norm
                best = max(best, float(np.linalg.norm(matrix @ u)))
    return best


@pytest.mark.parametrize(("bands", "steps"), [(1, 6), (2, 7), (3, 9), (4, 9), (5, 8), (9, 9)])
def test_the_sensitivity_under_min_separated_participation_is_the_brute_force_maximum(bands, steps):
    matrix = strategy_matrix(bands, steps)
    norms = column_norms(bands, steps)
    expected = brute_force_sensitivity(matrix, separation=bands)
    assert participation_sensitivity(norms, bands) == pytest.approx(expected, rel=1e-12)
    # Participations closer than the band overlap in C's columns: the bound would not hold.
    if 1 < bands < steps:
        assert brute_force_sensitivity(matrix, bands - 1) > expected * (1 + 1e-6)


# ----------------------------------------------------------------------------------------------
# The noise


def noise_over_steps(mechanism, steps: int, width: int) -> np.ndarray:
    """steps x width: the noise the mechanism adds to a zero average at each step."""
    rows = []
    for step in range(steps):
        average = {"a": torch.zeros(width // 2), "b": torch.zeros(width - width // 2)}
        mechanism.add_noise(average, step)
        rows.append(torch.cat(list(average.values())).double().numpy())
    return np.stack(rows)


def test_the_noise_is_correlated_across_steps_as_c_inverse_z():
    """Per coordinate the noise over T steps is C_clip·σ·C⁻¹z, z ~ N(0, I): its covariance across
    steps is (C_clip·σ)²·C⁻¹C⁻ᵀ and that of its prefix sums (what SGD sums up) (C_clip·σ)²·BBᵀ,
    B = AC⁻¹, far below DP-SGD's (C_clip·σ)²·min(s, t) at the last steps."""
    bands, steps, width, clip, sigma = 3, 6, 60_000, 0.5, 0.02
    mechanism = make_mechanism(bandmf(bands, clip_bound=clip), 30, sigma, cohort=3, seed=7,
                               sampling="poisson")  # fmt: skip
    noise = noise_over_steps(mechanism, steps, width) / (clip * sigma)
    inverse = np.linalg.inv(strategy_matrix(bands, steps))
    # Every entry of an empirical covariance of unit-scale variables over 60,000 coordinates is
    # within ~4 standard errors (1/√60,000 ≈ 0.004) of its expectation.
    np.testing.assert_allclose(np.cov(noise), inverse @ inverse.T, atol=0.03)
    prefix = np.cumsum(noise, axis=0)
    workload = np.tril(np.ones((steps, steps))) @ inverse
    np.testing.assert_allclose(np.cov(prefix), workload @ workload.T, atol=0.06)
    assert np.var(prefix[-1]) < 0.5 * steps  # DP-SGD's last prefix sum: variance `steps`


def test_a_resume_mid_band_continues_the_correlated_noise_exactly(tmp_path):
    """The last b-1 noise vectors are the mechanism's state: through a checkpoint file, a fresh
    mechanism continues bit for bit (Fault caught: a history not saved, or saved out of order)."""
    privacy = bandmf(4)
    like = {"w": torch.zeros(64), "b": torch.zeros(5)}

    def run(mechanism, steps):
        out = []
        for step in steps:
            average = {n: torch.zeros_like(t) for n, t in like.items()}
            mechanism.add_noise(average, step)
            out.append(average)
        return out

    straight = make_mechanism(privacy, 12, 0.1, cohort=3, sampling="poisson", seed=1)
    expected = run(straight, range(7))
    first = make_mechanism(privacy, 12, 0.1, cohort=3, sampling="poisson", seed=1)
    run(first, range(3))  # two noise vectors of history, one short of the band's three
    save_checkpoint(tmp_path / "step.safetensors", first.state_dict(), {})
    tensors, _ = load_checkpoint(tmp_path / "step.safetensors")
    resumed = make_mechanism(privacy, 12, 0.1, cohort=3, sampling="poisson", seed=1)
    resumed.load_state_dict(tensors)
    for got, want in zip(run(resumed, range(3, 7)), expected[3:], strict=True):
        assert all(torch.equal(got[n], want[n]) for n in like)
    with pytest.raises(ValueError, match="BandMF noise for step 9, but its history ends at step 6"):
        run(resumed, [9])


def test_with_one_band_bandmf_is_the_gaussian_mechanism_bit_for_bit():
    """C = I: the same cohorts, denominator, noise and ε as the Gaussian mechanism."""
    users, cohort, sigma = 200, 10, 0.05
    one = make_mechanism(bandmf(1), users, sigma, cohort=cohort, sampling="poisson", seed=3)
    gauss = make_mechanism(PrivacyRecipe(clipping="global", clip_bound=1.0), users, sigma,
                           cohort=cohort, sampling="poisson", seed=3)  # fmt: skip
    assert one.denominator == gauss.denominator
    for step in range(6):
        assert torch.equal(one.cohort(step), gauss.cohort(step))
    np.testing.assert_array_equal(noise_over_steps(one, 4, 100), noise_over_steps(gauss, 4, 100))
    described = BandMFMechanism.describe(bandmf(1), 0.7, 5000, 50, 300)
    assert described.reduced() == SampledGaussian(0.7, 50 / 5000, 300)


# ----------------------------------------------------------------------------------------------
# Participation


def test_the_sampler_enforces_cyclic_poisson_participation():
    """Each user is eligible only at the steps of its group t mod b, so its participations are at
    least b apart; within its group it is sampled at q_b = b·S/K (expected cohort S); a user's
    group depends on its own id only (adding a user moves nobody else)."""
    users, cohort, bands, steps = 600, 12, 4, 400
    ids = [f"spk{i}" for i in range(users)]
    mechanism = make_mechanism(bandmf(bands), ids, cohort=cohort, sampling="poisson", seed=5)
    groups = mechanism.groups
    counts = np.zeros(users)
    last = np.full(users, -(10**9))
    sizes = []
    for step in range(steps):
        sampled = mechanism.cohort(step)
        assert bool((groups[sampled] == step % bands).all())
        assert bool((step - last[sampled.numpy()] >= bands).all())
        last[sampled.numpy()] = step
        counts[sampled.numpy()] += 1
        sizes.append(len(sampled))
    rate = bands * cohort / users
    eligible = np.bincount(groups.numpy(), minlength=bands)[np.arange(steps) % bands]
    # Participations over the eligible steps: rate q_b within 4 standard errors.
    expected = float(eligible.sum()) * rate
    assert abs(counts.sum() - expected) < 4 * math.sqrt(expected)
    assert np.mean(sizes) == pytest.approx(cohort, rel=0.1)
    assert min(np.bincount(groups.numpy())) > users / bands / 2  # every group populated
    more = make_mechanism(bandmf(bands), ["newcomer", *ids], cohort=cohort, sampling="poisson",
                          seed=5)  # fmt: skip
    assert torch.equal(more.groups[1:], groups)


def test_bandmf_refuses_what_its_analysis_does_not_cover():
    with pytest.raises(UserError, match="does not support adaptive_clip"):
        check_mechanism_recipe(Recipe(privacy=bandmf(4, adaptive_clip={})))
    with pytest.raises(UserError, match="does not support noise_placement: client"):
        check_mechanism_recipe(
            Recipe(privacy=bandmf(4, noise_placement="client"), federated={"sampling": "fixed"})
        )
    with pytest.raises(UserError, match="does not support federated.sampling: fixed"):
        check_mechanism_recipe(Recipe(privacy=bandmf(4), federated={"sampling": "fixed"}))
    with pytest.raises(UserError, match="needs at least b\\*S = 80 users .* got K = 50"):
        make_mechanism(bandmf(8), 50, cohort=10, sampling="poisson")
    for bands in (True, "4"):  # a YAML true or a quoted number is not a band count
        with pytest.raises(
            UserError, match=f"bands: Input should be a valid integer .got {bands!r}"
        ):
            check_mechanism_recipe(Recipe(privacy=bandmf(bands)))


# ----------------------------------------------------------------------------------------------
# Accounting


def test_bandmf_epsilon_is_the_equivalent_sampled_gaussian_s():
    """By hand: 4 bands, column norm √(1 + 1/4 + 9/64 + 25/256), rate 4·S/K, ⌈T/4⌉ steps."""
    z, population, cohort, steps = 1.3, 40_000, 100, 2034
    described = BandMFMechanism.describe(bandmf(4), z, population, cohort, steps)
    assert described == BandMF(z, 0.01, steps, 4, described.column_norm, described.sensitivity)
    norm = math.sqrt(1 + 1 / 4 + 9 / 64 + 25 / 256)
    assert described.column_norm == pytest.approx(norm, rel=1e-15)
    # T = 2034 = 4·508 + 2: group 0's 509 steps, 508 full columns and the last, step 2032, with
    # two rows of C left below it; no 4-separated pattern does better.
    assert described.sensitivity == pytest.approx(math.sqrt(508 * norm**2 + 1 + 1 / 4), rel=1e-12)
    by_hand = SampledGaussian(z / norm, 4 * cohort / population, 509)
    for accountant in ("rdp", "pld"):
        result = compute_epsilon(described, DELTA, accountant)
        assert result.epsilon == compute_epsilon(by_hand, DELTA, accountant).epsilon
        assert (result.noise_multiplier, result.steps) == (pytest.approx(z / norm), 509)
        assert result.details["reduced_from"]["kind"] == "bandmf"
        assert "Thm. 4" in result.details["reduced_from"]["reduction"]


def test_a_budget_calibrates_bandmf_to_its_epsilon_and_refuses_extrapolating_past_q_b_1():
    budget = Budget(name="b", epsilon=7.2, delta=DELTA, population=566_773, cohort=1670, steps=2034)
    noise = budget_noise(budget, bandmf(8))
    described = BandMFMechanism.describe(
        bandmf(8), noise["noise_multiplier"], budget.population, budget.cohort, budget.steps
    )
    assert noise["sampling_rate"] == 8 * 1670 / 566_773 and described.reduced().steps == 255
    assert compute_epsilon(described, DELTA).epsilon == pytest.approx(7.2, rel=1e-3)
    assert compute_epsilon(described, DELTA).epsilon <= 7.2
    # More noise than the Gaussian mechanism's per step (fewer, denser rounds), same ε.
    assert noise["sigma_dp"] > 1.5 * budget_noise(budget)["sigma_dp"]
    small = budget.model_copy(update={"population": 10_000})
    with pytest.raises(UserError, match=r"q_b = b\*S/K = 1.34 > 1"):
        budget_noise(small, bandmf(8))


def test_submit_re_accounts_a_bandmf_record_and_catches_a_tampered_one():
    registry = load_registry()
    config = resolve(
        registry, "synth-cv-en-ls-seed", "bandmf-perlayer-dim", "eps7.2-synth-m-cohort-matched"
    )
    claim = json.loads(json.dumps(privacy_claim(config, run_sigma_dp(config), 1200)))
    assert "BandMF DP-FTRL with 8 bands" in claim["mechanism"] and "Thm. 4" in claim["how"]
    steps = config.recipe.federated.central_steps
    assert claim["simulated"]["bandmf"]["as_sampled_gaussian"]["steps"] == steps // 8  # T / bands
    check_record_privacy(claim, config, config.budget, "record")
    tampered = [
        ("extrapolated", "bandmf", "column_norm", 1.5),  # a larger z/‖Ce‖: a smaller ε
        ("extrapolated", "bandmf", "bands", 4),
        ("simulated", "sampling_rate", None, 16 / 1200),  # the Gaussian's q
        ("extrapolated", "epsilon", "rdp", None),
    ]
    for scale, key, inner, value in tampered:
        edited = json.loads(json.dumps(claim))
        if key == "epsilon":
            edited[scale]["epsilon"]["rdp"]["epsilon"] = 6.0
        elif inner is None:
            edited[scale][key] = value
        else:
            edited[scale][key][inner] = value
        with pytest.raises(UserError, match=f"privacy.{scale}"):
            check_record_privacy(edited, config, config.budget, "record")
    gaussian = dict(claim, mechanism=claim["mechanism"].replace("BandMF DP-FTRL", "Gaussian"))
    with pytest.raises(UserError, match="privacy.mechanism is"):
        check_record_privacy(gaussian, config, config.budget, "record")


def test_a_bandmf_step_through_the_aggregator_clips_then_adds_the_correlated_noise():
    """The aggregator is unchanged for BandMF: the Gaussian clipping, then BandMF's add_noise
    (only under DP: without noise it keeps no history)."""
    for sigma in (0.0, 0.3):
        mechanism = make_mechanism(
            bandmf(2, clip_bound=1.0), 10, sigma, cohort=2, sampling="poisson"
        )
        twin = make_mechanism(bandmf(2, clip_bound=1.0), 10, sigma, cohort=2, sampling="poisson")
        aggregator = StepAggregator({"w": torch.zeros(2)}, mechanism, 0, 10.0)
        aggregator.add({"w": torch.tensor([3.0, 4.0])}, "u0", 0.0, 1, 1)
        grads, _ = aggregator.finish()
        noise = {"w": torch.zeros(2, dtype=torch.float64)}
        if sigma:
            twin.add_noise(noise, 0)
        expected = torch.tensor([0.6, 0.8], dtype=torch.float64) / mechanism.denominator
        torch.testing.assert_close(grads[0], (expected + noise["w"]).float())
        assert bool(noise["w"].abs().min() > 0) == bool(sigma)
        assert mechanism.next_step == (1 if sigma else 0)
