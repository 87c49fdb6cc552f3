"""Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping").

The clip bound follows a target quantile γ of the users' update norms: each of the n sampled users
(audit canaries included) reports the bit b_i = [‖Δ_i‖ ≤ C_t]; the server releases the centred
sum over the expected cohort E with Gaussian noise of std f (the `bit_noise`, relative like σ_DP),
shifts it back by ½, and moves the bound geometrically,

    b̄ = Σ (b_i − ½) / E + ½ + N(0, f²),     C_{t+1} = C_t · exp(−η (b̄ − γ)).

The bits are a second Gaussian mechanism on the same sampled users. Adding or removing a user
changes the centred sum by ½ (the plain Σ b_i by 1: the number of users taking part is private
under Poisson sampling), so releasing the update average (noise std σ_Δ relative to C) and the bit
average (std f) is the Gaussian mechanism with one relative noise σ, σ⁻² = σ_Δ⁻² + (2f)⁻² (their
Thm. 1, and tensorflow_privacy's quantile estimator; multiply every σ by E for noise
multipliers). Without the centring the bits' sensitivity would be 1 and the split f⁻². pflbench
keeps the budget's σ_DP for the accountant — the ε statement is unchanged — and spends part of it
on the bits: the update noise rises to σ_Δ = (σ_DP⁻² − (2f)⁻²)^(-1/2).
"""

from __future__ import annotations

import math

import torch

from pflbench.errors import UserError


def update_noise(sigma_dp: float, bit_noise: float) -> float:
    """σ_Δ: the update's relative noise once the bits take their share of the budget's σ_DP."""
    if sigma_dp <= 0:
        return 0.0
    if 2 * bit_noise <= sigma_dp:
        raise UserError(
            f"adaptive clipping: bit_noise {bit_noise:g} must exceed sigma_dp/2 = {sigma_dp / 2:g}"
            " (the bits would use up the whole budget)"
        )
    return (sigma_dp**-2 - (2 * bit_noise) ** -2) ** -0.5


def combined_noise(update_sigma: float, bit_noise: float) -> float:
    """σ of the single Gaussian mechanism equivalent to releasing both averages."""
    return (update_sigma**-2 + (2 * bit_noise) ** -2) ** -0.5


def noisy_unclipped_fraction(
    unclipped: float,
    participants: float,
    expected_cohort: float,
    bit_noise: float,
    generator: torch.Generator,
) -> float:
    """b̄: the centred count of the `participants` whose update was within the bound, over the
    expected cohort, noised, plus ½ (sensitivity ½ per user)."""
    noise = torch.randn((), generator=generator, dtype=torch.float64).item() * bit_noise
    return (unclipped - participants / 2) / expected_cohort + 0.5 + noise


def next_clip_bound(
    clip_bound: float, unclipped_fraction: float, target: float, lr: float
) -> float:
    """C_{t+1} = C_t·exp(−η(b̄ − γ)): shrink when more than γ of the users fit, grow otherwise."""
    if not (clip_bound > 0 and math.isfinite(clip_bound)):
        raise ValueError(f"clip bound must be finite and > 0, got {clip_bound}")
    return clip_bound * math.exp(-lr * (unclipped_fraction - target))


def adaptive_statement(sigma_dp: float, adaptive) -> dict:
    """For the record's privacy claim: how adaptive clipping spends the budget's σ_DP."""
    bit_noise = adaptive.bit_noise if sigma_dp > 0 else 0.0
    update_sigma = update_noise(sigma_dp, bit_noise) if bit_noise else sigma_dp
    return {
        **adaptive.model_dump(mode="json"),
        "bit_noise_applied": bit_noise,
        "update_sigma": update_sigma,
        "how": "Adaptive clipping (Andrew et al. 2021): clip_bound is the initial bound C_0; each"
        " step releases the fraction of sampled users within C_t with noise of std"
        f" {bit_noise:g} and adds update noise of std C_t*{update_sigma:.6g}; together the two"
        f" Gaussian releases are the mechanism with sigma_dp = {sigma_dp:.6g}"
        " (sigma_dp^-2 = update_sigma^-2 + (2*bit_noise)^-2), which the epsilons account for.",
    }
