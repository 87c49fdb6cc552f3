"""The registry of privacy accountants, and epsilon and noise calibration through it.

Each accountant is one module with an `ACCOUNTANT` (pflbench.privacy.accounting.Accountant):

- "rdp": Renyi DP via opacus (the paper's moments accountant; pflbench.privacy.rdp).
- "pld": privacy loss distributions via dp_accounting, tighter (pflbench.privacy.pld).
- "prv": privacy random variables via prv_accountant, a cross-check (pflbench.privacy.prv).

Everything that enumerates accountants (budgets' and records' names, CLI choices, privacy
statements, exports, benches) reads ACCOUNTANTS: adding one is a module, an entry registered in
ACCOUNTANTS (here, or from a plug-in: pflbench.plugins) and its test.
"""

from __future__ import annotations

import math

from pflbench.errors import UserError
from pflbench.extension import ExtensionPoint
from pflbench.privacy import pld, prv, rdp
from pflbench.privacy.accounting import Accountant, EpsilonResult

ACCOUNTANTS = ExtensionPoint(
    "accountant", ((a.name, a) for a in (rdp.ACCOUNTANT, pld.ACCOUNTANT, prv.ACCOUNTANT))
)


def calibrating() -> tuple[str, ...]:
    """The accountants a budget may name: they calibrate z and carry the record's claim."""
    return tuple(name for name, a in ACCOUNTANTS.items() if a.calibrates)


# Calibration search range for the noise multiplier and its relative tolerance.
Z_MIN, Z_MAX, Z_RTOL = 1e-6, 1e4, 1e-4


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


def get_accountant(name: str, calibrating_only: bool = False) -> Accountant:
    """The registered accountant `name` (one that calibrates, if asked); UserError listing the
    choices otherwise."""
    choices = calibrating() if calibrating_only else tuple(ACCOUNTANTS)
    if name not in choices:
        purpose = " for calibrating noise" if calibrating_only else ""
        raise UserError(f"unknown accountant {name!r}{purpose}; choose one of {', '.join(choices)}")
    return ACCOUNTANTS[name]


def compute_epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> EpsilonResult:
    """Epsilon of T-fold Poisson(q)-subsampled Gaussian(z) at delta. Results are cached."""
    check_mechanism(noise_multiplier, sampling_rate, steps, delta)
    epsilon = get_accountant(accountant).epsilon
    return epsilon(float(noise_multiplier), float(sampling_rate), int(steps), float(delta))


def clear_cache() -> None:
    for a in ACCOUNTANTS.values():
        a.epsilon.cache_clear()


def calibrate_noise(
    target_epsilon: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Smallest noise multiplier z (to relative tolerance Z_RTOL) with epsilon(z) <= target.

    Bisection in log z; the returned z is always one whose epsilon was computed and found
    <= target by `compute_epsilon` itself.
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise UserError(f"target epsilon must be finite and > 0, got {target_epsilon}")
    check_mechanism(1.0, sampling_rate, steps, delta)
    get_accountant(accountant, calibrating_only=True)

    def fits(z: float) -> bool:
        epsilon = compute_epsilon(z, sampling_rate, steps, delta, accountant).epsilon
        return epsilon <= target_epsilon

    # The others are at most the RDP epsilon, so the RDP answer brackets theirs from above.
    hi = 1.0
    if accountant != "rdp":
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
