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
from collections.abc import Callable
from dataclasses import replace

from pflbench.errors import UserError
from pflbench.extension import ExtensionPoint
from pflbench.privacy import pld, prv, rdp
from pflbench.privacy.accounting import Accountant, EpsilonResult, MechanismDescription

ACCOUNTANTS = ExtensionPoint(
    "accountant", ((a.name, a) for a in (rdp.ACCOUNTANT, pld.ACCOUNTANT, prv.ACCOUNTANT))
)


def calibrating() -> tuple[str, ...]:
    """The accountants a budget may name: they calibrate z and carry the record's claim."""
    return tuple(name for name, a in ACCOUNTANTS.items() if a.calibrates)


# Calibration search range for the noise multiplier and its relative tolerance.
Z_MIN, Z_MAX, Z_RTOL = 1e-6, 1e4, 1e-4


def check_delta(delta: float) -> None:
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
    mechanism: MechanismDescription, delta: float, accountant: str = "rdp"
) -> EpsilonResult:
    """Epsilon of the described mechanism at delta by `accountant` (results are cached). A
    description the accountant does not analyse is first reduced to one it does; the result's
    details then say from what and by which theorem."""
    mechanism.check()
    check_delta(delta)
    chosen = get_accountant(accountant)
    analysed = mechanism
    while not isinstance(analysed, chosen.analyses):
        analysed = analysed.reduced()
        if analysed is None:
            raise UserError(f"the {accountant} accountant cannot analyse a {mechanism.kind}")
    result = chosen.epsilon(analysed, float(delta))
    if analysed is mechanism:
        return result
    return replace(result, details={**result.details, "reduced_from": mechanism.record()})


def clear_cache() -> None:
    for a in ACCOUNTANTS.values():
        a.epsilon.cache_clear()


def calibrate_noise(
    target_epsilon: float,
    mechanism: Callable[[float], MechanismDescription],
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Smallest noise multiplier z (to relative tolerance Z_RTOL) with epsilon(mechanism(z)) <=
    target, for a family of descriptions `mechanism(z)` whose epsilon falls as z grows.

    Bisection in log z; the returned z is always one whose epsilon was computed and found
    <= target by `compute_epsilon` itself.
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise UserError(f"target epsilon must be finite and > 0, got {target_epsilon}")
    mechanism(1.0).check()
    check_delta(delta)
    get_accountant(accountant, calibrating_only=True)

    def fits(z: float) -> bool:
        return compute_epsilon(mechanism(z), delta, accountant).epsilon <= target_epsilon

    # The others are at most the RDP epsilon, so the RDP answer brackets theirs from above.
    hi = 1.0
    if accountant != "rdp":
        hi = calibrate_noise(target_epsilon, mechanism, delta, "rdp")
    lo = hi
    if fits(hi):
        while lo > Z_MIN and fits(lo):
            hi, lo = lo, lo / 2
    else:
        while not fits(hi):
            if hi >= Z_MAX:
                described = mechanism(hi)
                raise UserError(
                    f"epsilon {target_epsilon} at delta {delta} needs a noise multiplier above"
                    f" {Z_MAX:g} (q={described.sampling_rate}, T={described.steps})"
                )
            lo, hi = hi, hi * 2
    while hi / lo - 1 > Z_RTOL:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi
