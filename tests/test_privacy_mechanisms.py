"""The privacy-mechanism interface (privacy/mechanisms/base.py): the Gaussian mechanism as one
object per run, its registry, its state, and accountants taking mechanism descriptions."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import make_mechanism
from hypothesis import given
from hypothesis import strategies as st

from pflbench.errors import UserError
from pflbench.fl.aggregate import StepAggregator
from pflbench.methods import check_recipe
from pflbench.privacy.accountants import compute_epsilon
from pflbench.privacy.accounting import SampledGaussian
from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS, PrivacyMechanism
from pflbench.privacy.sampling import (
    RATE_GRID,
    expected_cohort,
    poisson_threshold,
    sample_cohort,
    sampling_rate,
)
from pflbench.seeds import keyed_generator
from pflbench.spec.models import AdaptiveClip, PrivacyRecipe, Recipe

K, S = 50, 8


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_the_gaussian_mechanism_samples_and_averages_as_the_paper(sampling):
    mechanism = make_mechanism(PrivacyRecipe(), K, cohort=S, sampling=sampling, seed=4)
    assert type(mechanism) is PRIVACY_MECHANISMS["gaussian"] is PrivacyMechanism
    for step in range(5):
        assert torch.equal(mechanism.cohort(step), sample_cohort(K, S, sampling, 4, step))
    assert mechanism.denominator == (expected_cohort(K, S) if sampling == "poisson" else S)
    description = PrivacyMechanism.describe(PrivacyRecipe(), 0.8, K, S, 30)
    assert description == SampledGaussian(0.8, S / K, 30)


def test_poisson_draws_are_on_a_2_to_the_minus_24_grid_so_their_rate_is_below_q_once_rounded():
    """Each user's inclusion probability is at most the q the accountant is given: torch's fp32
    uniform draws are the multiples k·2^-24, k < 2^24 (checked here, as the premise), so `draw <
    t` holds with probability t for t on that grid, and the threshold is q rounded down onto it.
    Compared with q itself, 10/1200 = 139810.13·2^-24 would include a user with probability
    139811·2^-24 > q."""
    draws = torch.rand(1 << 22, generator=torch.Generator().manual_seed(3)).double() / RATE_GRID
    assert torch.equal(draws, draws.round()) and 0 <= draws.min() and draws.max() < 2**24
    q = sampling_rate(1200, 10)
    assert poisson_threshold(q) < q < poisson_threshold(q) + RATE_GRID
    # Seed 0's step 17159 draws exactly that grid point for user 362 (found by search): the
    # sampler leaves the user out, as it does with the probability 2^-24 of that draw.
    draws = torch.rand(1200, generator=keyed_generator(0, 17159, "cohort"))
    assert float(draws[362]) == poisson_threshold(q)
    assert 362 not in sample_cohort(1200, 10, "poisson", 0, 17159).tolist()


@given(st.integers(1, 10**6), st.integers(1, 10**4))
def test_the_poisson_threshold_is_the_largest_grid_point_at_most_q(population, cohort):
    q = sampling_rate(population, cohort)
    threshold = poisson_threshold(q)
    assert threshold <= q < threshold + RATE_GRID
    assert (threshold / RATE_GRID).is_integer()


def test_the_average_is_divided_by_exactly_min_s_k():
    # q·K in floating point is 1 ulp short of S for some pairs: 15/22·22 = 14.999999999999998.
    assert (15 / 22) * 22 < 15
    for population, cohort in [(22, 15), (1200, 16), (34753, 1024), (10, 16)]:
        assert expected_cohort(population, cohort) == min(cohort, population)
        for sampling in ("poisson", "fixed"):
            mechanism = make_mechanism(
                PrivacyRecipe(), population, cohort=cohort, sampling=sampling, seed=4
            )
            assert mechanism.denominator == min(cohort, population)


def test_adaptive_clipping_s_bound_is_the_mechanism_s_state_and_resumes_exactly():
    """C_t moves inside the mechanism at the end of each step; a mechanism loaded from its state
    continues with the same bounds and releases (Fault caught: a C_t not checkpointed)."""
    privacy = PrivacyRecipe(clipping="global", clip_bound=0.5, adaptive_clip=AdaptiveClip())

    def step(mechanism, t):
        aggregator = StepAggregator({"w": torch.zeros(4)}, mechanism, t, 10.0)
        for user in range(S):
            aggregator.add({"w": torch.full((4,), 0.1 * user)}, f"u{user}", 0.0, 1, 1)
        return aggregator.finish()[1]

    first = make_mechanism(privacy, S, sigma_dp=0.02, seed=2)
    for t in range(3):
        step(first, t)
    state = first.state_dict()
    assert float(state["clip_bound"]) == first.clip_bound != 0.5
    resumed = make_mechanism(privacy, S, sigma_dp=0.02, seed=2)
    resumed.load_state_dict(state)
    for t in range(3, 5):
        assert step(resumed, t) == step(first, t)
    assert resumed.clip_bound == first.clip_bound


def test_a_recipe_naming_an_unknown_mechanism_or_bad_options_is_refused():
    with pytest.raises(UserError, match="unknown privacy mechanism 'dp-magic'; known: gaussian"):
        check_recipe({"privacy": {"mechanism": "dp-magic"}}, "baseline x")
    with pytest.raises(UserError, match="privacy.mechanism_options of 'gaussian'"):
        check_recipe(Recipe(privacy={"mechanism_options": {"bands": 3}}), "task y")


@dataclass(frozen=True)
class Doubled:
    """A description no built-in accountant analyses: as private as the sampled Gaussian at half
    its noise multiplier (`halves`: False, it reduces to nothing)."""

    kind: ClassVar[str] = "doubled"
    noise_multiplier: float
    sampling_rate: float
    steps: int
    halves: bool = True

    def check(self) -> None:
        SampledGaussian(self.noise_multiplier, self.sampling_rate, self.steps).check()

    def reduced(self) -> SampledGaussian | None:
        if not self.halves:
            return None
        return SampledGaussian(self.noise_multiplier / 2, self.sampling_rate, self.steps)

    def record(self) -> dict:
        return {"kind": self.kind, "noise_multiplier": self.noise_multiplier}


def test_an_accountant_reduces_a_description_it_does_not_analyse():
    """compute_epsilon hands an accountant only what it analyses: a description of another kind
    goes through its `reduced()`, and the result says from what; one that reduces to nothing the
    accountant knows is refused."""
    rdp = compute_epsilon(Doubled(2.0, 0.01, 100), 1e-6, "rdp")
    direct = compute_epsilon(SampledGaussian(1.0, 0.01, 100), 1e-6, "rdp")
    assert rdp.epsilon == direct.epsilon and rdp.noise_multiplier == 1.0
    assert rdp.details["reduced_from"] == {"kind": "doubled", "noise_multiplier": 2.0}
    assert "reduced_from" not in direct.details
    with pytest.raises(UserError, match="the pld accountant cannot analyse a doubled"):
        compute_epsilon(Doubled(2.0, 0.01, 100, halves=False), 1e-6, "pld")
