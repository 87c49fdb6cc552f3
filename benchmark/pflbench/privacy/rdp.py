"""The "rdp" accountant: Renyi DP via opacus' analysis functions (the paper's moments
accountant), converted to (eps, delta) with Balle et al. 2020 (Thm. 21), minimized over a grid of
fractional and large orders. Reproduces the paper's Tables 1 and 17.
"""

from __future__ import annotations

import functools
import math
import warnings
from importlib.metadata import version

import numpy as np

from pflbench.errors import UserError
from pflbench.privacy.accounting import Accountant, EpsilonResult, SampledGaussian

LIBRARY = "opacus"

# opacus' default orders (1.1..10.9 by 0.1, 12..63) plus large orders for small epsilons.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10 for x in range(1, 100)]
    + [float(a) for a in range(12, 64)]
    + [64.0, 80.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0]
)


def rdp_epsilon(
    z: float, q: float, steps: int, delta: float, orders: tuple[float, ...] = RDP_ORDERS
) -> tuple[float, float]:
    """(epsilon, best order) by opacus' RDP analysis over `orders` (no validation)."""
    from opacus.accountants.analysis import rdp as opacus_rdp

    grid = np.array(orders, dtype=float)
    # opacus' compute_rdp is one step's curve times `steps`: the same product, bit for bit, from
    # the cached curve (a run's ε after each step costs one curve, not one per step: ~0.2 s).
    rdp = one_step_rdp(z, q, orders) * steps
    with warnings.catch_warnings():  # opacus warns when the best order is at the grid's edge
        warnings.simplefilter("ignore")
        eps, order = opacus_rdp.get_privacy_spent(orders=grid, rdp=rdp, delta=delta)
    return float(eps), float(order)


@functools.lru_cache(maxsize=256)
def one_step_rdp(z: float, q: float, orders: tuple[float, ...] = RDP_ORDERS) -> np.ndarray:
    """opacus' RDP curve of one step of the Poisson(q)-subsampled Gaussian(z), read-only."""
    from opacus.accountants.analysis import rdp as opacus_rdp

    grid = np.array(orders, dtype=float)
    curve = opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=grid)
    curve.flags.writeable = False
    return curve


@functools.lru_cache(maxsize=4096)
def epsilon(mechanism: SampledGaussian, delta: float) -> EpsilonResult:
    z, q, steps = mechanism.noise_multiplier, mechanism.sampling_rate, mechanism.steps
    eps, order = rdp_epsilon(z, q, steps, delta)
    return EpsilonResult(
        accountant="rdp",
        library=LIBRARY,
        library_version=version(LIBRARY),
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


def summary(details: dict) -> str:
    orders = details["orders"]
    return f"{len(orders)} orders {orders[0]:g}..{orders[-1]:g}"


ACCOUNTANT = Accountant(
    name="rdp",
    description="RDP (opacus, best of a grid of orders)",
    library=LIBRARY,
    epsilon=epsilon,
    summary=summary,
    calibrates=True,
)


def epsilon_at_most(limit: float, mechanism: SampledGaussian, delta: float, refusal: str) -> float:
    """The RDP epsilon (an upper bound on the tighter accountants'), or a UserError `refusal`
    when it exceeds `limit`: the grid-based accountants cannot represent such epsilons."""
    rdp_epsilon = epsilon(mechanism, delta).epsilon
    if not rdp_epsilon <= limit:
        raise UserError(
            f"{refusal} (RDP gives {rdp_epsilon:.3g} > {limit:g}); use the rdp accountant"
        )
    return rdp_epsilon
