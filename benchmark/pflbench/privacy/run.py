"""The privacy side of one run: what a budget may run, its noise, ε so far and the record's claim.

`pflbench run` and the sweep refuse a configuration before any process starts when its budget
cannot hold (`check_run_privacy`); `pflbench submit` checks a finished record's claim against the
same rules (results/submit.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from pflbench.errors import UserError
from pflbench.privacy.accountants import ACCOUNTANTS, compute_epsilon
from pflbench.privacy.audit import check_audit
from pflbench.privacy.example import check_budget_unit, check_example_recipe
from pflbench.privacy.mechanisms import check_mechanism_recipe
from pflbench.privacy.statement import (
    budget_noise,
    check_steps_within_budget,
    described_at_scale,
    privacy_statement,
)
from pflbench.spec.models import RunConfig

DEFAULT_DELTA = 1e-9  # δ for the simulated-scale statement of runs without a DP budget

NO_FL_PRIVACY = {
    "seed-only": "No federated training: the seed model never sees the federated users' data,"
    " so this row spends no privacy budget on them (and claims no DP guarantee).",
    "central": "Central fine-tuning on the pooled federated data without clipping or noise:"
    " no DP guarantee (epsilon is infinite).",
}


def check_run_privacy(config: RunConfig) -> None:
    """Refuse runs a DP budget cannot cover: DP noise is calibrated to a clipping bound (so the
    baseline must clip), to the budget's T (so the run may not take more central steps) and to
    the run's privacy mechanism (which must fit the recipe and be accountable at the budget's
    scale); the central and seed-only rows have no DP mechanism at all; a budget's unit (user or
    example) must be its training's."""
    training = config.recipe.training
    check_example_recipe(config.recipe)
    check_budget_unit(config.budget, training, config.baseline.name)
    if training == "dpsgd-example":
        return
    if config.budget.dp and training != "federated":
        raise UserError(
            f"baseline {config.baseline.name!r} (training: {training}) is a non-private reference"
            f" row, so budget {config.budget.name!r} cannot be met; use --budget none"
        )
    check_audit(config.recipe)
    try:
        check_mechanism_recipe(config.recipe)
    except UserError as exc:  # the options may come from the baseline or a --set: say whose
        raise UserError(
            f"task {config.task.name!r}, baseline {config.baseline.name!r}: {exc}"
        ) from None
    check_sampling_accountable(config, "federated.sampling")
    if config.budget.dp and config.recipe.privacy.clipping == "none":
        raise UserError(
            f"baseline {config.baseline.name!r} does not clip client updates "
            f"(privacy.clipping: none), so budget {config.budget.name!r} cannot be met; "
            "use --budget none or a clipping baseline"
        )
    steps = config.recipe.federated.central_steps
    privacy = config.recipe.privacy
    check_steps_within_budget(steps, config.budget, "federated.central_steps", privacy)
    # The mechanism's noise for the budget: refused now where the mechanism cannot be accounted at
    # the budget's scale (BandMF with more bands than the extrapolated population allows).
    budget_noise(config.budget, privacy)


def check_sampling_accountable(config: RunConfig, where: str) -> None:
    """A DP budget needs Poisson cohorts: the accountants analyse Poisson sampling, and fixed-size
    cohorts are not as private. Adding a user to a fixed cohort displaces another, so the noised
    sum moves by up to 2C, not C: at eps7.2-synth-m-cohort-matched's scale the ε of one such pair
    of neighbouring datasets is already ~60 (a rigorous lower bound), against the 7.2 claimed."""
    if config.budget.dp and config.recipe.federated.sampling == "fixed":
        raise UserError(
            f"{where}: fixed-size cohorts under DP budget {config.budget.name!r}: the "
            "accountants analyse Poisson sampling, and a fixed cohort is not covered (a user "
            "added to it displaces another, so the noised sum moves by up to 2C, not C; its ε "
            "can be several times the budget's). Use federated.sampling: poisson "
            "(noise_placement: client needs fixed cohorts, so it cannot run under a DP budget)"
        )


def run_sigma_dp(config: RunConfig) -> float:
    """σ_DP of the run: the budget's for its mechanism (0 without DP)."""
    return float(budget_noise(config.budget, config.recipe.privacy)["sigma_dp"])


def epsilon_so_far(config: RunConfig, sigma_dp: float, population: int, steps: int) -> float | None:
    """ε by RDP at the simulated scale after `steps` central steps (None without noise)."""
    if sigma_dp == 0 or steps == 0:
        return None
    cohort = min(config.recipe.federated.cohort_size, population)
    described = described_at_scale(config.recipe.privacy, sigma_dp, cohort, population, steps)
    return compute_epsilon(described, config.budget.delta or DEFAULT_DELTA, "rdp").epsilon


def privacy_claim(
    config: RunConfig, sigma_dp: float, population: int, accountants: Sequence[str] = ACCOUNTANTS
) -> dict:
    """The record's `privacy`: the statement of a federated run, or why a reference row has none.
    `accountants`: whose ε it states (a run: every registered one; older records had fewer)."""
    if config.recipe.training != "federated":
        return {"dp": False, "how": NO_FL_PRIVACY[config.recipe.training]}
    fed = config.recipe.federated
    statement = privacy_statement(
        sigma_dp=sigma_dp,
        clip_bound=config.recipe.privacy.clip_bound,
        cohort=min(fed.cohort_size, population),
        population=population,
        steps=fed.central_steps,
        delta=config.budget.delta or DEFAULT_DELTA,
        sampling=fed.sampling,
        budget=config.budget if config.budget.dp else None,
        pseudo_users=config.task.federated_data.iid,
        privacy=config.recipe.privacy,
        accountants=tuple(accountants),
    )
    adaptive = config.recipe.privacy.adaptive_clip
    if adaptive is not None:
        from pflbench.privacy.adaptive import adaptive_statement

        statement["adaptive_clipping"] = adaptive_statement(sigma_dp, adaptive)
    return statement
