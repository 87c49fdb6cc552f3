"""Adaptive clipping: the noise split keeps the budget's noise multiplier, the bound tracks the
target quantile, and the noised fraction has the stated noise."""

import math

import pytest
import torch

from pflbench.errors import UserError
from pflbench.privacy.adaptive import (
    combined_noise,
    next_clip_bound,
    noisy_unclipped_fraction,
    update_noise,
)


@pytest.mark.parametrize("sigma", [3e-6, 3.68e-4, 1.2e-3, 0.5])
@pytest.mark.parametrize("ratio", [0.51, 1.0, 10.0, 1e3])
def test_update_and_bit_noise_compose_to_the_budgets_noise(sigma, ratio):
    bit_noise = ratio * sigma  # must exceed sigma/2
    update_sigma = update_noise(sigma, bit_noise)
    assert update_sigma > sigma  # the update pays for the bits with more noise
    assert combined_noise(update_sigma, bit_noise) == pytest.approx(sigma, rel=1e-9)
    # Gaussian RDP at any order α is α·Δ²/(2σ²): the update has sensitivity 1 (in units of C),
    # the centred bits 1/2. Composed, they are exactly the budget's mechanism at every order.
    for alpha in (1.5, 8.0, 64.0):
        composed = alpha / (2 * update_sigma**2) + alpha * 0.25 / (2 * bit_noise**2)
        assert composed == pytest.approx(alpha / (2 * sigma**2), rel=1e-9)


def test_bits_that_would_use_the_whole_budget_are_refused():
    with pytest.raises(UserError, match="must exceed sigma_dp/2"):
        update_noise(2.0, 1.0)
    assert update_noise(0.0, 1.0) == 0.0  # no DP: nothing to split


def test_bound_converges_to_the_target_quantile_of_the_update_norms():
    gen = torch.Generator().manual_seed(0)
    norms = torch.exp(torch.randn(100_000, generator=gen) * 0.7 - 3.0)  # log-normal, median e^-3
    for target in (0.3, 0.5, 0.9):
        bound = 1.0  # far above every norm
        for _ in range(400):
            fraction = (norms <= bound).double().mean().item()
            bound = next_clip_bound(bound, fraction, target, lr=0.2)
        reached = (norms <= bound).double().mean().item()
        assert abs(reached - target) < 0.02, (target, reached)


def test_bound_moves_the_right_way():
    assert next_clip_bound(1.0, 1.0, 0.5, 0.2) == pytest.approx(math.exp(-0.1))  # all fit: shrink
    assert next_clip_bound(1.0, 0.0, 0.5, 0.2) == pytest.approx(math.exp(0.1))  # none fit: grow
    assert next_clip_bound(1.0, 0.5, 0.5, 0.2) == 1.0
    with pytest.raises(ValueError):
        next_clip_bound(float("nan"), 0.5, 0.5, 0.2)


def test_noised_fraction_has_the_stated_std():
    gen = torch.Generator().manual_seed(1)
    samples = torch.tensor(
        [noisy_unclipped_fraction(8.0, 16.0, 16.0, 0.05, gen) for _ in range(20_000)],
        dtype=torch.float64,
    )
    assert samples.mean().item() == pytest.approx(0.5, abs=0.002)
    assert samples.std().item() == pytest.approx(0.05, rel=0.03)


@pytest.mark.parametrize("expected_cohort", [1.0, 16.0, 1000.0])
@pytest.mark.parametrize("participants", [0, 1, 7, 16, 40])
def test_one_user_moves_the_released_fraction_by_half_a_bit(participants, expected_cohort):
    """The sensitivity the noise split assumes (½ per user, in units of 1/E): adding a user,
    within the bound or not, moves the noiseless release by exactly 1/(2E); an uncentred count
    would move it by 1/E when the user is within."""
    gen = torch.Generator().manual_seed(0)
    for within in range(participants + 1):
        before = noisy_unclipped_fraction(within, participants, expected_cohort, 0.0, gen)
        for bit in (0, 1):
            after = noisy_unclipped_fraction(
                within + bit, participants + 1, expected_cohort, 0.0, gen
            )
            assert abs(after - before) == pytest.approx(0.5 / expected_cohort, rel=1e-12)
    # With the expected number of users taking part, it is the plain fraction within the bound.
    assert noisy_unclipped_fraction(12.0, 16.0, 16.0, 0.0, gen) == 12.0 / 16.0
