"""The "prv" accountant: privacy random variables (Gopi, Lee and Wutschitz 2021, "Numerical
composition of differential privacy") via Microsoft's prv_accountant, a third cross-check.

The privacy loss of one step is discretized on a grid and composed T times by FFT with a proven
error bound: the library returns a lower bound, an estimate and an upper bound on epsilon, and the
record gets the upper bound, so the number is a valid epsilon, never an optimistic one.

Error parameters: delta_error = delta / 1000 (the library's and opacus' choice); eps_error =
max(PRV_EPS_ERROR, PRV_RELATIVE_EPS_ERROR * eps_rdp), i.e. opacus' 0.01 for the epsilons budgets
care about (~1-2 s at T = 2000), relative beyond that because the grid's spacing is proportional
to eps_error and its width to epsilon: a fixed eps_error would make large epsilons' grids huge.

It is a cross-check only, not a budget's accountant: the library's
PoissonSubsampledGaussianMechanism is the privacy loss of the mixture against N(0, z^2), the
remove half of the add-or-remove relation. The PLD accountant takes the larger of both halves, so
PRV agreeing with PLD (tests/test_privacy_prv.py) also checks that the remove half is the larger.
"""

from __future__ import annotations

import functools
import math
from importlib.metadata import version

import numpy as np

from pflbench.errors import UserError
from pflbench.privacy import rdp
from pflbench.privacy.accounting import Accountant, EpsilonResult, SampledGaussian

LIBRARY = "prv_accountant"
PRV_EPS_ERROR = 0.01
PRV_RELATIVE_EPS_ERROR = 1e-3
PRV_RELATIVE_DELTA_ERROR = 1e-3
# Beyond this the grid gets slow (~10 s at 1e3) and, around 1e4, the library's discretization
# fails its own checks; such epsilons mean "no privacy" anyway.
PRV_MAX_RDP_EPSILON = 1e3
# lower_bound's grid: 5x coarser than the records', so a check costs seconds where the records'
# precision takes ~5x that; the bound stays proven, about max(0.05, 0.5% of ε) under the true ε
# (0.8% at the paper's ε 6.3, 5% at ε 1).
FLOOR_EPS_ERROR, FLOOR_RELATIVE_EPS_ERROR = 0.05, 5e-3


def eps_error(rdp_epsilon: float) -> float:
    return max(PRV_EPS_ERROR, PRV_RELATIVE_EPS_ERROR * rdp_epsilon)


def prv_bounds(z: float, q: float, steps: int, delta: float, error: float) -> tuple[float, ...]:
    """(lower, estimate, upper) epsilon by prv_accountant (no validation, no cache)."""
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    mechanism = PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=z)
    with np.errstate(all="ignore"):  # its cdf overflows harmlessly in the far tails
        accountant = PRVAccountant(
            prvs=mechanism,
            max_self_compositions=steps,
            eps_error=error,
            delta_error=PRV_RELATIVE_DELTA_ERROR * delta,
        )
        return accountant.compute_epsilon(delta=delta, num_self_compositions=[steps])


@functools.lru_cache(maxsize=4096)
def epsilon(mechanism: SampledGaussian, delta: float) -> EpsilonResult:
    z, q, steps = mechanism.noise_multiplier, mechanism.sampling_rate, mechanism.steps
    rdp_epsilon = rdp.epsilon_at_most(
        PRV_MAX_RDP_EPSILON, mechanism, delta,
        "PRV accountant not run: epsilon is very large, beyond what its privacy loss grid"
        " handles well",
    )  # fmt: skip
    error = eps_error(rdp_epsilon)
    try:
        lower, estimate, upper = prv_bounds(z, q, steps, delta, error)
    except (ValueError, RuntimeError, FloatingPointError) as exc:
        raise UserError(f"PRV accountant failed numerically: {exc}") from None
    if not (math.isfinite(upper) and upper >= 0):
        raise UserError(f"PRV accountant failed numerically: upper bound {upper}")
    return EpsilonResult(
        accountant="prv",
        library=LIBRARY,
        library_version=version(LIBRARY),
        epsilon=float(upper),
        delta=delta,
        noise_multiplier=z,
        sampling_rate=q,
        steps=steps,
        order=None,
        details={
            "epsilon_lower_bound": float(lower),
            "epsilon_estimate": float(estimate),
            "epsilon_upper_bound": float(upper),
            "reported": "upper bound",
            "eps_error": error,
            "delta_error": PRV_RELATIVE_DELTA_ERROR * delta,
            "error_rule": (
                f"eps_error = max({PRV_EPS_ERROR:g}, {PRV_RELATIVE_EPS_ERROR:g} * eps_rdp),"
                f" delta_error = {PRV_RELATIVE_DELTA_ERROR:g} * delta"
            ),
            "mechanism": f"PoissonSubsampledGaussianMechanism(q={q}, z={z}) composed {steps}x",
            "neighboring_relation": "remove half of add_or_remove_one",
        },
    )


@functools.lru_cache(maxsize=256)
def lower_bound(mechanism: SampledGaussian, delta: float) -> tuple[float, int] | None:
    """(bound, T'): a proven lower bound on the add-or-remove ε of the Poisson-subsampled
    Gaussian, for checking other accountants' numbers. It is prv_accountant's lower bound on the
    remove half's ε (the add-or-remove ε is the larger of the two halves') at T' steps, the most
    T' <= T whose RDP ε the PRV grid handles (halved while the library's discretization fails):
    composing more steps never lowers ε. None where not even one step's is computed (noise so
    small that no accountant's ε means anything)."""
    z, q, steps = mechanism.noise_multiplier, mechanism.sampling_rate, mechanism.steps

    def rdp_at(t: int) -> float:
        return rdp.epsilon(SampledGaussian(z, q, t), delta).epsilon

    if not rdp_at(1) <= PRV_MAX_RDP_EPSILON:
        return None
    fits = steps
    if not rdp_at(steps) <= PRV_MAX_RDP_EPSILON:  # bisection for the most steps that fit
        fits, beyond = 1, steps
        while beyond - fits > 1:
            mid = (fits + beyond) // 2
            fits, beyond = (mid, beyond) if rdp_at(mid) <= PRV_MAX_RDP_EPSILON else (fits, mid)
    while True:  # the library's discretization can fail below that range too: fewer steps
        error = max(FLOOR_EPS_ERROR, FLOOR_RELATIVE_EPS_ERROR * rdp_at(fits))
        try:
            lower, _, _ = prv_bounds(z, q, fits, delta, error)
        except (ValueError, RuntimeError, FloatingPointError):
            lower = math.nan
        if math.isfinite(lower):
            return float(lower), fits
        if fits == 1:
            return None
        fits //= 2


def summary(details: dict) -> str:
    return (
        f"upper bound, estimate {details['epsilon_estimate']:.4g}"
        f" (eps_error {details['eps_error']:g})"
    )


ACCOUNTANT = Accountant(
    name="prv",
    description="PRV (prv_accountant, upper bound)",
    library=LIBRARY,
    epsilon=epsilon,
    summary=summary,
    calibrates=False,
    # FFT convolutions, as PLD's.
    agreement_rtol=1e-4,
)
