"""Privacy accountants for the Poisson-subsampled Gaussian mechanism composed over T steps.

- "rdp": Renyi DP via opacus' analysis functions (the paper's moments accountant), converted to
  (eps, delta) with Balle et al. 2020 (Thm. 21), minimized over a grid of fractional and large
  orders. Reproduces the paper's Tables 1 and 17.
- "pld": privacy loss distributions via dp_accounting (pessimistic discretization): tighter.

Both use the add-or-remove-one-user neighbouring relation. Noise multiplier z is the Gaussian
std relative to the L2 sensitivity (the clip bound C).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Literal

import numpy as np

from pflbench.errors import UserError

Accountant = Literal["rdp", "pld"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld")

# opacus' default orders (1.1..10.9 by 0.1, 12..63) plus large orders for small epsilons.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10 for x in range(1, 100)]
    + [float(a) for a in range(12, 64)]
    + [64.0, 80.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0]
)

# PLD grid step on the privacy-loss axis, proportional to the RDP epsilon (an upper bound on the
# PLD one) so the grid has a bounded number of points: ~0.1 s per epsilon at T=2000, error of
# the (pessimistic, i.e. still valid) bound ~1e-4 relative. Beyond PLD_MAX_RDP_EPSILON the loss
# values overflow dp_accounting's grid; such epsilons mean "no privacy" anyway.
PLD_RELATIVE_INTERVAL = 1e-5
PLD_MIN_INTERVAL = 1e-3
PLD_MAX_INTERVAL = 500.0
PLD_MAX_RDP_EPSILON = 1e10

# Calibration search range for the noise multiplier and its relative tolerance.
Z_MIN, Z_MAX, Z_RTOL = 1e-6, 1e4, 1e-4


@dataclass(frozen=True)
class EpsilonResult:
    accountant: str
    library: str
    library_version: str
    epsilon: float
    delta: float
    noise_multiplier: float
    sampling_rate: float
    steps: int
    order: float | None
    details: dict = field(default_factory=dict)  # orders list or PLD discretization


def check_mechanism(
    noise_multiplier: float, sampling_rate: float, steps: int, delta: float
) -> None:
    """UserError naming the first invalid parameter."""
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise UserError(f"noise multiplier must be finite and > 0, got {noise_multiplier}")
    if not 0 < sampling_rate <= 1:
        raise UserError(f"sampling rate q must be in (0, 1], got {sampling_rate}")
    if int(steps) != steps or steps < 1:
        raise UserError(f"steps must be an integer >= 1, got {steps}")
    if not 0 < delta < 1:
        raise UserError(f"delta must be in (0, 1), got {delta}")


def check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise UserError(
            f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}"
        )


def compute_epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> EpsilonResult:
    """Epsilon of T-fold Poisson(q)-subsampled Gaussian(z) at delta. Results are cached."""
    check_mechanism(noise_multiplier, sampling_rate, steps, delta)
    check_accountant(accountant)
    args = (float(noise_multiplier), float(sampling_rate), int(steps), float(delta))
    return _cached_rdp(*args) if accountant == "rdp" else _cached_pld(*args)


def rdp_epsilon(
    z: float, q: float, steps: int, delta: float, orders: tuple[float, ...] = RDP_ORDERS
) -> tuple[float, float]:
    """(epsilon, best order) by opacus' RDP analysis over `orders` (no validation, no cache)."""
    from opacus.accountants.analysis import rdp as opacus_rdp

    grid = np.array(orders, dtype=float)
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=grid)
    with warnings.catch_warnings():  # opacus warns when the best order is at the grid's edge
        warnings.simplefilter("ignore")
        eps, order = opacus_rdp.get_privacy_spent(orders=grid, rdp=rdp, delta=delta)
    return float(eps), float(order)


@functools.lru_cache(maxsize=4096)
def _cached_rdp(z: float, q: float, steps: int, delta: float) -> EpsilonResult:
    eps, order = rdp_epsilon(z, q, steps, delta)
    return EpsilonResult(
        accountant="rdp",
        library="opacus",
        library_version=version("opacus"),
        epsilon=eps,
        delta=delta,
        noise_multiplier=z,
        sampling_rate=q,
        steps=steps,
        order=None if math.isnan(order) else order,
        details={
            "orders": list(RDP_ORDERS),
            "order_at_grid_edge": order in (RDP_ORDERS[0], RDP_ORDERS[-1]),
            "conversion": "Balle et al. 2020, Thm. 21 (opacus get_privacy_spent)",
            "neighboring_relation": "add_or_remove_one",
        },
    )


def pld_interval(rdp_epsilon: float) -> float:
    """PLD value discretization interval for a mechanism whose RDP epsilon is `rdp_epsilon`."""
    interval = PLD_RELATIVE_INTERVAL * rdp_epsilon
    return min(max(interval, PLD_MIN_INTERVAL), PLD_MAX_INTERVAL)


@functools.lru_cache(maxsize=4096)
def _cached_pld(z: float, q: float, steps: int, delta: float) -> EpsilonResult:
    import dp_accounting
    from dp_accounting import pld

    rdp_epsilon = _cached_rdp(z, q, steps, delta).epsilon
    if not rdp_epsilon <= PLD_MAX_RDP_EPSILON:
        raise UserError(
            f"PLD accountant not run: epsilon is astronomically large (RDP gives {rdp_epsilon:.3g}"
            f" > {PLD_MAX_RDP_EPSILON:g}), beyond what its discretized grid can represent;"
            " use the rdp accountant"
        )
    interval = pld_interval(rdp_epsilon)
    accountant = pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=interval,
    )
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return EpsilonResult(
        accountant="pld",
        library="dp_accounting",
        library_version=version("dp-accounting"),
        epsilon=float(accountant.get_epsilon(delta)),
        delta=delta,
        noise_multiplier=z,
        sampling_rate=q,
        steps=steps,
        order=None,
        details={
            "value_discretization_interval": interval,
            "discretization_rule": (
                f"clip({PLD_RELATIVE_INTERVAL:g} * eps_rdp, {PLD_MIN_INTERVAL:g},"
                f" {PLD_MAX_INTERVAL:g})"
            ),
            "pessimistic_estimate": True,
            "event": f"SelfComposed(PoissonSampled({q}, Gaussian({z})), {steps})",
            "neighboring_relation": "add_or_remove_one",
        },
    )


def clear_cache() -> None:
    _cached_rdp.cache_clear()
    _cached_pld.cache_clear()


def calibrate_noise(
    target_epsilon: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """Smallest noise multiplier z (to relative tolerance Z_RTOL) with epsilon(z) <= target.

    Bisection in log z; the returned z is always one whose epsilon was computed and found
    <= target by `compute_epsilon` itself.
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise UserError(f"target epsilon must be finite and > 0, got {target_epsilon}")
    check_mechanism(1.0, sampling_rate, steps, delta)
    check_accountant(accountant)

    def fits(z: float) -> bool:
        return compute_epsilon(z, sampling_rate, steps, delta, accountant).epsilon <= target_epsilon

    # PLD is at most the RDP epsilon, so the RDP answer brackets the PLD one from above.
    hi = 1.0
    if accountant == "pld":
        hi = calibrate_noise(target_epsilon, sampling_rate, steps, delta, "rdp")
    lo = hi
    if fits(hi):
        while lo > Z_MIN and fits(lo):
            hi, lo = lo, lo / 2
    else:
        while not fits(hi):
            if hi >= Z_MAX:
                raise UserError(
                    f"epsilon {target_epsilon} at delta {delta} needs a noise multiplier above"
                    f" {Z_MAX:g} (q={sampling_rate}, T={steps})"
                )
            lo, hi = hi, hi * 2
    while hi / lo - 1 > Z_RTOL:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi
