"""Example-level DP (paper 003): the privacy side of DP-SGD, through opacus' own accountants.

One DP neighbour adds or removes one training example (one utterance of the pooled federated
training data), not all of a user's utterances: an example-level ε says nothing about a speaker
with many utterances and is not comparable with the user-level ε of federated runs. Budgets say
which they are (`unit: example` in tasks/budgets.yaml), and records and the leaderboard label it.

The mechanism is opacus' DP-SGD: every step samples each of the N examples independently with
probability q = B/N (Poisson), clips each sampled example's gradient to L2 norm C (globally, or
each tensor h to C_h with Σ C_h² = C²; exactly, by pflbench's clipping in opacus' optimizer,
privacy.example_optimizer), adds N(0, z²C²) to the sum and divides by B. An
example-level budget is (ε, δ) alone: z is calibrated at the run's own N, q and T by opacus'
`get_noise_multiplier` with the budget's accountant, and the record's ε is that accountant's for
(z, q, T, δ), which `pflbench submit` recomputes.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import asdict
from importlib.metadata import version

from pflbench.errors import UserError
from pflbench.privacy import accountants
from pflbench.privacy.accounting import EpsilonResult, SampledGaussian
from pflbench.privacy.rdp import one_step_rdp
from pflbench.privacy.sampling import sampling_rate
from pflbench.spec.models import Budget, ExampleDPRecipe, PrivacyRecipe, Recipe

LIBRARY = "opacus"
# The accountants an example-level budget may name -> opacus' name of its accounting mechanism.
EXAMPLE_ACCOUNTANTS = {"opacus-rdp": "rdp", "opacus-prv": "prv"}
NO_BUDGET_ACCOUNTANT = "opacus-rdp"  # reports "ε so far" and names a run's ε without a budget
# Calibration: opacus' bisection stops within this ε below the target (its default, 0.01).
EPSILON_TOLERANCE = 0.01

MECHANISM = (
    "example-level DP-SGD (paper 003, opacus): every step samples each of the N training"
    " examples (utterances) independently with probability q = B/N, clips each sampled"
    " example's gradient to L2 norm C ({clipping}; exactly, as user-level clipping: norms in"
    " fp64 and a proven rounding margin keep every example's scaled gradient as stored within"
    " C), adds Gaussian noise of std z*C to the sum and divides it by the expected batch B;"
    " Poisson-subsampled Gaussian mechanism with noise multiplier z, composed over T steps. One"
    " neighbour differs in one example, not in a user's data"
)


def check_example_accountant(name: str) -> str:
    """opacus' mechanism name of an example-level accountant; UserError listing the choices."""
    if name not in EXAMPLE_ACCOUNTANTS:
        raise UserError(
            f"unknown accountant {name!r} for an example-level budget; choose one of"
            f" {', '.join(EXAMPLE_ACCOUNTANTS)} (opacus' own)"
        )
    return EXAMPLE_ACCOUNTANTS[name]


@functools.lru_cache(maxsize=1024)
def example_epsilon(
    noise_multiplier: float, q: float, steps: int, delta: float, accountant: str
) -> EpsilonResult:
    """ε of T steps of the Poisson(q)-subsampled Gaussian(z) by opacus' accountant `accountant`
    (its default orders or discretization, as opacus' PrivacyEngine reports it)."""
    from opacus.accountants import create_accountant
    from opacus.accountants.analysis import rdp as privacy_analysis

    mechanism = check_example_accountant(accountant)
    SampledGaussian(noise_multiplier, q, steps).check()
    accountants.check_delta(delta)
    counter = create_accountant(mechanism)
    counter.history = [(float(noise_multiplier), float(q), int(steps))]
    order = None
    with warnings.catch_warnings():  # opacus warns when the best order is at the grid's edge
        warnings.simplefilter("ignore")
        if mechanism == "rdp":
            # What counter.get_privacy_spent computes (the sum of compute_rdp over its history,
            # here one entry: one step's curve times T), from rdp.one_step_rdp's cache: the same
            # numbers bit for bit, and a run's ε after each step costs one curve, not one per step.
            alphas = counter.DEFAULT_ALPHAS
            curve = one_step_rdp(float(noise_multiplier), float(q), tuple(alphas)) * int(steps)
            epsilon, order = privacy_analysis.get_privacy_spent(
                orders=alphas, rdp=curve, delta=delta
            )
            details = {"orders": list(alphas)}
        else:
            epsilon = counter.get_epsilon(delta=delta)
            details = {"eps_error": 0.01, "delta_error": delta / 1000, "bound": "upper"}
    return EpsilonResult(
        accountant=accountant,
        library=LIBRARY,
        library_version=version(LIBRARY),
        epsilon=float(epsilon),
        delta=delta,
        noise_multiplier=noise_multiplier,
        sampling_rate=q,
        steps=steps,
        order=order,
        details={
            "class": f"opacus.accountants.{type(counter).__name__}",
            **details,
            "neighboring_relation": "add_or_remove_one_example",
        },
    )


def example_noise_multiplier(budget: Budget, q: float, steps: int) -> float:
    """z for an example-level budget at the run's own q and T (0 without DP): opacus'
    get_noise_multiplier with the budget's accountant, so that ε(z) <= the budget's ε."""
    if not budget.dp:
        return 0.0
    from opacus.accountants.utils import get_noise_multiplier

    mechanism = check_example_accountant(budget.accountant)
    SampledGaussian(1.0, q, steps).check()
    accountants.check_delta(budget.delta)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(
                get_noise_multiplier(
                    target_epsilon=budget.epsilon,
                    target_delta=budget.delta,
                    sample_rate=q,
                    steps=steps,
                    accountant=mechanism,
                    epsilon_tolerance=EPSILON_TOLERANCE,
                )
            )
    except ValueError as exc:  # opacus: "The privacy budget is too low."
        raise UserError(
            f"budget {budget.name!r}: opacus finds no noise multiplier for ε = {budget.epsilon}"
            f" at δ = {budget.delta}, q = {q:.4g}, T = {steps} ({exc})"
        ) from None


def expected_batch(seconds: list[float], batch_seconds: float) -> int:
    """B, the expected Poisson batch in examples: as many as `batch_seconds` of audio hold on
    average (at least 1, at most all)."""
    if not seconds:
        raise UserError("example-level DP-SGD needs training examples; the data has none")
    total = sum(seconds)
    return min(len(seconds), max(1, round(batch_seconds * len(seconds) / total)))


def check_example_recipe(recipe: Recipe) -> None:
    """What `training: dpsgd-example` can run (UserError otherwise), and that no other training
    carries example_dp settings it would ignore."""
    if recipe.training != "dpsgd-example":
        if recipe.example_dp != ExampleDPRecipe():
            raise UserError(
                f"example_dp is set but training is {recipe.training}: it applies to training:"
                " dpsgd-example only"
            )
        return
    privacy = recipe.privacy
    refusals = {
        "privacy.clipping: none (DP-SGD clips every example's gradient; the unclipped"
        " reference is baseline central)": privacy.clipping == "none",
        "privacy.perlayer_rule: normalize (example-level per-layer clipping clips each layer"
        " to min(‖g_h‖, C_h): perlayer_rule clip)": privacy.clipping == "perlayer"
        and privacy.perlayer_rule != "clip",
        "privacy.adaptive_clip": privacy.adaptive_clip is not None,
        "privacy.audit_canaries (the canary audit inserts users)": privacy.audit_canaries > 0,
        "privacy.noise_placement: client": privacy.noise_placement != "server",
    }
    refused = [what for what, set_ in refusals.items() if set_]
    if refused:
        raise UserError(f"training: dpsgd-example cannot run with {'; '.join(refused)}")


def check_budget_unit(budget: Budget, training: str, baseline: str) -> None:
    """A DP budget's unit must be the training's: example-level DP-SGD takes example-level
    budgets, federated training user-level ones (UserError naming both otherwise)."""
    if not budget.dp:
        return
    example_training = training == "dpsgd-example"
    if example_training and budget.unit != "example":
        raise UserError(
            f"baseline {baseline!r} trains with example-level DP-SGD (training: dpsgd-example),"
            f" but budget {budget.name!r} is user-level (unit: {budget.unit}): its ε would be"
            " claimed per user. Use an example-level budget (unit: example) or --budget none"
        )
    if budget.unit == "example" and not example_training:
        raise UserError(
            f"budget {budget.name!r} is example-level (unit: example), but baseline"
            f" {baseline!r} runs training: {training}; an example-level budget applies to"
            " training: dpsgd-example only (use a user-level budget)"
        )


def check_delta_below_one_over_n(delta: float, examples: int, budget: str) -> None:
    """δ must be below 1/N: at δ >= 1/N, releasing one random example verbatim satisfies
    (0, δ)-DP, so the guarantee would be void."""
    if not delta < 1 / examples:
        raise UserError(
            f"budget {budget!r}: δ = {delta:g} is not below 1/N = {1 / examples:.3g} for the"
            f" run's N = {examples} training examples; use a budget with a smaller δ"
        )


def clipping_words(privacy: PrivacyRecipe) -> str:
    """How an example-level statement names the run's clipping."""
    if privacy.clipping == "perlayer":
        return f"per layer, C_h by {privacy.perlayer_mode}"
    return privacy.clipping


def example_statement(
    noise_multiplier: float,
    clip_bound: float,
    clipping: str,
    examples: int,
    batch: int,
    steps: int,
    budget: Budget,
) -> dict:
    """The record's `privacy` for an example-level DP-SGD run: unit example, the accountant's ε
    (opacus, name and version) at the run's N examples, expected batch B (q = B/N), T steps and
    the budget's δ; sigma_dp = z/B is the noise std on the averaged gradient relative to C (as a
    user-level claim's on the averaged update). JSON-ready."""
    dp = noise_multiplier > 0
    accountant = budget.accountant if budget.dp else NO_BUDGET_ACCOUNTANT
    delta = budget.delta if budget.dp else None
    q = sampling_rate(examples, batch)
    epsilon = None
    if dp:
        epsilon = asdict(example_epsilon(noise_multiplier, q, steps, delta, accountant))
    simulated = {
        "population": examples,
        "cohort": batch,
        "steps": steps,
        "delta": delta,
        "sampling_rate": q,
        "noise_multiplier": noise_multiplier,
        "epsilon": {accountant: epsilon},
    }
    return {
        "dp": dp,
        "mechanism": MECHANISM.format(clipping=clipping),
        "unit": "example",
        "sigma_dp": noise_multiplier / batch,
        "clip_bound": clip_bound,
        "sampling": "poisson",
        "claimed_by": accountant if dp else None,
        "simulated": simulated,
        "extrapolated": None,
        "how": how_sentence(simulated, epsilon),
    }


def how_sentence(simulated: dict, epsilon: dict | None) -> str:
    if epsilon is None:
        return (
            "No DP noise (no example-level budget): every example's gradient is clipped, but ε is"
            " infinite."
        )
    scale = f"q = B/N = {simulated['cohort']}/{simulated['population']}, T = {simulated['steps']}"
    return (
        f"Example-level ε = {epsilon['epsilon']:.4g} at δ = {simulated['delta']:g}, computed by"
        f" opacus {epsilon['library_version']} ({epsilon['details']['class']}) for the Poisson-"
        "subsampled Gaussian mechanism with noise multiplier z ="
        f" {simulated['noise_multiplier']:.6g} at sampling rate {scale} steps, the run's own"
        " scale (no extrapolation). One DP neighbour differs in one example (an utterance):"
        " this ε is per example, not per user, and is not comparable with the user-level ε of"
        " federated runs."
    )
