"""Budgets and privacy statements: what goes into result records about (epsilon, delta).

A budget names a target (eps, delta) at an extrapolated scale (K_ext, S_ext, T_ext) and the
accountant that is its one source of truth: it calibrates z, and its epsilon is the record's
claim against the target (`claimed_by`); the other accountants are reported as cross-checks. The
budget's noise is sigma_dp = z / S_ext. A run trains at its own (K, S, T <= T_ext) with that
sigma_dp; its statement gives epsilon at the simulated scale (z = sigma_dp * S, honest and
usually huge) and at the budget's extrapolated scale (z = sigma_dp * S_ext, McMahan et al. 2018).
A run with more central steps than T_ext is refused: the budget's epsilon would not hold for it.

The privacy mechanism (privacy/mechanisms, `privacy.mechanism`) says how it is accounted at a
scale (`describe`: the description the accountants analyse) and in what words; the Gaussian
mechanism's description is the Poisson-subsampled Gaussian with z = sigma_dp * S, q = S/K.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Literal

from pflbench.errors import UserError
from pflbench.privacy.accountants import (
    ACCOUNTANTS,
    calibrate_noise,
    compute_epsilon,
    get_accountant,
)
from pflbench.privacy.accounting import MechanismDescription
from pflbench.privacy.mechanisms import mechanism_class
from pflbench.spec.models import Budget, PrivacyRecipe

GAUSSIAN = PrivacyRecipe()  # the privacy recipe of statements that name no mechanism


def budget_described(
    budget: Budget, privacy: PrivacyRecipe, noise_multiplier: float, steps: int
) -> MechanismDescription:
    """The mechanism `privacy` names at the budget's extrapolated scale, run for `steps` steps."""
    return mechanism_class(privacy).describe(
        privacy, noise_multiplier, budget.population, budget.cohort, steps
    )


def budget_noise(budget: Budget, privacy: PrivacyRecipe = GAUSSIAN) -> dict:
    """The noise a budget prescribes to the mechanism `privacy` names: z calibrated at the
    budget's extrapolated scale, sigma_dp = z/S_ext."""
    if not budget.dp:
        return {"budget": budget.name, "dp": False, "noise_multiplier": 0.0, "sigma_dp": 0.0}

    def at(z: float) -> MechanismDescription:
        return budget_described(budget, privacy, z, budget.steps)

    z = calibrate_noise(budget.epsilon, at, budget.delta, budget.accountant)
    q = at(z).sampling_rate
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


def check_steps_within_budget(
    steps: int, budget: Budget, where: str, privacy: PrivacyRecipe = GAUSSIAN
) -> None:
    """UserError when a run's central steps exceed the T its budget is calibrated for: the
    budget's epsilon holds for at most T_ext steps. Names both step counts and the epsilon the
    run would have at the extrapolated scale with its own T."""
    if not budget.dp or steps <= budget.steps:
        return
    noise = budget_noise(budget, privacy)
    described = budget_described(budget, privacy, noise["noise_multiplier"], steps)
    real = compute_epsilon(described, budget.delta, budget.accountant).epsilon
    raise UserError(
        f"{where}: {steps} central steps but budget {budget.name!r} is calibrated for T ="
        f" {budget.steps}; at T = {steps} its epsilon would be {real:.2f} > {budget.epsilon:g}"
        f" ({budget.accountant}). Run at most {budget.steps} central steps under this budget."
    )


def check_scale(cohort: int, population: int, steps: int) -> None:
    if population < 1 or not 1 <= cohort <= population:
        raise UserError(
            f"need 1 <= cohort <= population, got cohort={cohort}, population={population}"
        )
    if steps < 1:
        raise UserError(f"steps must be >= 1, got {steps}")


def described_at_scale(
    privacy: PrivacyRecipe, sigma_dp: float, cohort: int, population: int, steps: int
) -> MechanismDescription:
    """The mechanism `privacy` names with noise sigma_dp at one (K, S, T) scale: z = sigma_dp*S."""
    return mechanism_class(privacy).describe(privacy, sigma_dp * cohort, population, cohort, steps)


def epsilons_at_scale(
    sigma_dp: float,
    cohort: int,
    population: int,
    steps: int,
    delta: float,
    accountants: Sequence[str],
    privacy: PrivacyRecipe = GAUSSIAN,
) -> dict:
    """Epsilon by each accountant for sigma_dp at one (K, S, T) scale; JSON-ready."""
    check_scale(cohort, population, steps)
    described = described_at_scale(privacy, sigma_dp, cohort, population, steps)
    scale = {
        "population": population,
        "cohort": cohort,
        "steps": steps,
        "delta": delta,
        "sampling_rate": described.sampling_rate,
        "noise_multiplier": described.noise_multiplier,
        **mechanism_class(privacy).scale_record(described),
        "epsilon": {},
    }
    for name in accountants:
        # None without noise: epsilon is infinite
        scale["epsilon"][name] = epsilon_entry(described, delta, name) if sigma_dp else None
    return scale


def epsilon_entry(mechanism: MechanismDescription, delta: float, accountant: str) -> dict:
    """One accountant's epsilon, JSON-ready; where it cannot compute one, epsilon is null and
    `error` says why (e.g. PLD or PRV at an astronomically large epsilon)."""
    try:
        return asdict(compute_epsilon(mechanism, delta, accountant))
    except UserError as exc:
        return {"accountant": accountant, "epsilon": None, "error": str(exc)}


def privacy_statement(
    sigma_dp: float,
    clip_bound: float,
    cohort: int,
    population: int,
    steps: int,
    delta: float,
    sampling: Literal["poisson", "fixed"],
    budget: Budget | None,
    accountants: Sequence[str] | None = None,
    pseudo_users: bool = False,
    privacy: PrivacyRecipe = GAUSSIAN,
) -> dict:
    """JSON-ready record of how private a run is, at its simulated and extrapolated scale.

    `claimed_by` names the accountant whose epsilon is the claim against the budget (the
    budget's own); `unit` is "pseudo-user" when users are random groups of utterances (-iid
    tasks), so the guarantee is per pseudo-user, not per speaker. `accountants`: None, every one
    registered when called (plug-ins included)."""
    accountants = tuple(ACCOUNTANTS) if accountants is None else accountants
    if not (sigma_dp >= 0 and math.isfinite(sigma_dp)):
        raise UserError(f"sigma_dp must be finite and >= 0, got {sigma_dp}")
    if not clip_bound > 0:
        raise UserError(f"clip bound must be > 0, got {clip_bound}")
    if sampling not in ("poisson", "fixed"):
        raise UserError(f"unknown sampling {sampling!r}; choose poisson or fixed")
    for name in accountants:
        get_accountant(name)
    dp = sigma_dp > 0
    extrapolated = None
    claimed_by = None
    if budget is not None and budget.dp:
        check_steps_within_budget(steps, budget, "privacy statement", privacy)
        claimed_by = budget.accountant
        if claimed_by not in accountants:
            accountants = (claimed_by, *accountants)
        extrapolated = epsilons_at_scale(
            sigma_dp, budget.cohort, budget.population, budget.steps, budget.delta, accountants,
            privacy,
        )  # fmt: skip
        extrapolated.update(budget=budget.name, target_epsilon=budget.epsilon)
    simulated = epsilons_at_scale(sigma_dp, cohort, population, steps, delta, accountants, privacy)
    unit = "pseudo-user" if pseudo_users else "user"
    mechanism = mechanism_class(privacy)
    how = how_sentence(
        dp, sampling, simulated, extrapolated, accountants, claimed_by, unit, privacy
    )
    return {
        "dp": dp,
        "mechanism": mechanism.statement(privacy, unit),
        "unit": unit,
        "sigma_dp": sigma_dp,
        "clip_bound": clip_bound,
        "sampling": sampling,
        "claimed_by": claimed_by,
        "simulated": simulated,
        "extrapolated": extrapolated,
        "how": how,
    }


def how_sentence(
    dp: bool,
    sampling: str,
    simulated: dict,
    extrapolated: dict | None,
    accountants: Sequence[str],
    claimed_by: str | None = None,
    unit: str = "user",
    privacy: PrivacyRecipe = GAUSSIAN,
) -> str:
    if not dp:
        return "No DP noise (sigma_dp = 0): epsilon is infinite; updates may still be clipped."
    described = [ACCOUNTANTS[a].description for a in accountants]
    mechanism = mechanism_class(privacy)
    text = (
        f"epsilon computed by {enumeration(described)} for"
        f" {mechanism.accounted_as(privacy, simulated)} at delta = {simulated['delta']:g}."
    )
    if extrapolated is not None:
        text += (
            f" Extrapolated (McMahan et al. 2018): the same sigma_dp at K = "
            f"{extrapolated['population']}, S = {extrapolated['cohort']}, T ="
            f" {extrapolated['steps']}, delta = {extrapolated['delta']:g} (budget"
            f" {extrapolated['budget']}), i.e. {mechanism.extrapolated_as(privacy, extrapolated)},"
            " assuming training quality is unchanged at that scale; the run's own T ="
            f" {simulated['steps']} is <= that T, so the extrapolated epsilon bounds it."
        )
    if claimed_by is not None:
        others = [a for a in accountants if a != claimed_by]
        cross_check = ""
        if others:
            verb = "is reported as a cross-check" if len(others) == 1 else "are cross-checks"
            cross_check = f"; {enumeration(others)} {verb}"
        text += (
            f" The claim against the budget is the {claimed_by} epsilon (the budget's"
            f" accountant){cross_check}."
        )
    if unit == "pseudo-user":
        text += (
            " Users are pseudo-users (utterances assigned to users at random, an -iid task): the"
            " guarantee protects one pseudo-user's utterances, not everything one speaker said."
        )
    if sampling == "fixed":
        text += (
            " The run sampled fixed-size cohorts (the paper's practice), but the accountants"
            " analyse Poisson sampling at q = S/K, and the epsilons above do not cover fixed"
            " cohorts: a user added to one displaces another, so the sum moves by up to 2C, and"
            " the epsilon can be several times larger (a DP budget refuses fixed cohorts)."
        )
    return text


def enumeration(items: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return " and ".join(filter(None, (", ".join(items[:-1]), items[-1])))
