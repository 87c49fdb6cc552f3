"""Budgets and privacy statements: what goes into result records about (epsilon, delta).

A budget names a target (eps, delta) at an extrapolated scale (K_ext, S_ext, T_ext). Its noise is
sigma_dp = z / S_ext with z calibrated by the accountant. A run trains at its own (K, S, T) with
that sigma_dp; its statement gives epsilon at the simulated scale (z = sigma_dp * S, honest and
usually huge) and at the budget's extrapolated scale (z = sigma_dp * S_ext, McMahan et al. 2018).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Literal

from pflbench.errors import UserError
from pflbench.privacy.accountants import (
    calibrate_noise,
    check_accountant,
    compute_epsilon,
)
from pflbench.spec.models import Budget

MECHANISM = (
    "user-level DP: each sampled user's update clipped to L2 norm C, Gaussian noise of std"
    " C*sigma_dp on the average (sum divided by the expected cohort qK); Poisson-subsampled"
    " Gaussian mechanism with noise multiplier z = sigma_dp*qK, composed over T central steps"
)


def budget_noise(budget: Budget) -> dict:
    """The noise a budget prescribes: z calibrated at its extrapolated scale, sigma_dp = z/S_ext."""
    if not budget.dp:
        return {"budget": budget.name, "dp": False, "noise_multiplier": 0.0, "sigma_dp": 0.0}
    q = budget.cohort / budget.population
    z = calibrate_noise(budget.epsilon, q, budget.steps, budget.delta, budget.accountant)
    return {
        "budget": budget.name,
        "dp": True,
        "accountant": budget.accountant,
        "target_epsilon": budget.epsilon,
        "delta": budget.delta,
        "population": budget.population,
        "cohort": budget.cohort,
        "steps": budget.steps,
        "sampling_rate": q,
        "noise_multiplier": z,
        "sigma_dp": z / budget.cohort,
    }


def check_scale(cohort: int, population: int, steps: int) -> None:
    if population < 1 or not 1 <= cohort <= population:
        raise UserError(
            f"need 1 <= cohort <= population, got cohort={cohort}, population={population}"
        )
    if steps < 1:
        raise UserError(f"steps must be >= 1, got {steps}")


def epsilons_at_scale(
    sigma_dp: float,
    cohort: int,
    population: int,
    steps: int,
    delta: float,
    accountants: Sequence[str],
) -> dict:
    """Epsilon by each accountant for sigma_dp at one (K, S, T) scale; JSON-ready."""
    check_scale(cohort, population, steps)
    q = cohort / population
    z = sigma_dp * cohort
    scale = {
        "population": population,
        "cohort": cohort,
        "steps": steps,
        "delta": delta,
        "sampling_rate": q,
        "noise_multiplier": z,
        "epsilon": {},
    }
    for name in accountants:
        if sigma_dp == 0:
            scale["epsilon"][name] = None  # no noise: epsilon is infinite
            continue
        try:
            result = asdict(compute_epsilon(z, q, steps, delta, name))
        except UserError as exc:  # e.g. PLD at an astronomically large epsilon
            result = {"accountant": name, "epsilon": None, "error": str(exc)}
        scale["epsilon"][name] = result
    return scale


def privacy_statement(
    sigma_dp: float,
    clip_bound: float,
    cohort: int,
    population: int,
    steps: int,
    delta: float,
    sampling: Literal["poisson", "fixed"],
    budget: Budget | None,
    accountants: Sequence[str] = ("rdp", "pld"),
) -> dict:
    """JSON-ready record of how private a run is, at its simulated and extrapolated scale."""
    if not (sigma_dp >= 0 and math.isfinite(sigma_dp)):
        raise UserError(f"sigma_dp must be finite and >= 0, got {sigma_dp}")
    if not clip_bound > 0:
        raise UserError(f"clip bound must be > 0, got {clip_bound}")
    if sampling not in ("poisson", "fixed"):
        raise UserError(f"unknown sampling {sampling!r}; choose poisson or fixed")
    for name in accountants:
        check_accountant(name)
    dp = sigma_dp > 0
    extrapolated = None
    if budget is not None and budget.dp:
        extrapolated = epsilons_at_scale(
            sigma_dp, budget.cohort, budget.population, budget.steps, budget.delta, accountants
        )
        extrapolated.update(budget=budget.name, target_epsilon=budget.epsilon)
    simulated = epsilons_at_scale(sigma_dp, cohort, population, steps, delta, accountants)
    return {
        "dp": dp,
        "mechanism": MECHANISM,
        "sigma_dp": sigma_dp,
        "clip_bound": clip_bound,
        "sampling": sampling,
        "simulated": simulated,
        "extrapolated": extrapolated,
        "how": how_sentence(dp, sampling, simulated, extrapolated, accountants),
    }


def how_sentence(
    dp: bool, sampling: str, simulated: dict, extrapolated: dict | None, accountants: Sequence[str]
) -> str:
    if not dp:
        return "No DP noise (sigma_dp = 0): epsilon is infinite; updates may still be clipped."
    names = {"rdp": "RDP (opacus, best of a grid of orders)", "pld": "PLD (dp_accounting)"}
    text = (
        f"epsilon computed by {' and '.join(names[a] for a in accountants)} for the Poisson-"
        f"subsampled Gaussian mechanism with noise multiplier z = sigma_dp * S ="
        f" {simulated['noise_multiplier']:.6g}, sampling rate q = S/K = {simulated['cohort']}/"
        f"{simulated['population']}, composed over T = {simulated['steps']} steps at delta ="
        f" {simulated['delta']:g}."
    )
    if extrapolated is not None:
        text += (
            f" Extrapolated (McMahan et al. 2018): the same sigma_dp at K = "
            f"{extrapolated['population']}, S = {extrapolated['cohort']}, T ="
            f" {extrapolated['steps']}, delta = {extrapolated['delta']:g} (budget"
            f" {extrapolated['budget']}), i.e. z = {extrapolated['noise_multiplier']:.6g},"
            " assuming training quality is unchanged at that scale."
        )
    if sampling == "fixed":
        text += (
            " The run sampled fixed-size cohorts (the paper's practice); the accountants assume"
            " Poisson sampling."
        )
    return text
