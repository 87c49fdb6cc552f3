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
from pflbench.privacy.accounting import (
    Accountant,
    EpsilonResult,
    MechanismDescription,
    SampledGaussian,
)

# The accountants pflbench ships: upper bounds, tested against one another. Any other entry, a
# plug-in's or one registered by other code, has its ε checked (check_not_below_lower_bound).
BUILT_IN = (rdp.ACCOUNTANT, pld.ACCOUNTANT, prv.ACCOUNTANT)
ACCOUNTANTS = ExtensionPoint("accountant", ((a.name, a) for a in BUILT_IN), entry_type=Accountant)


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
    details then say from what and by which theorem. An accountant pflbench does not ship (a
    plug-in's, or one other code registered) has its ε checked against a proven lower bound
    (`check_not_below_lower_bound`)."""
    result, analysed = _accounted(mechanism, delta, accountant)
    if ACCOUNTANTS[accountant] not in BUILT_IN:
        check_not_below_lower_bound(accountant, result, analysed, delta)
    return result


def _accounted(
    mechanism: MechanismDescription, delta: float, accountant: str
) -> tuple[EpsilonResult, MechanismDescription]:
    """(ε result, the description the accountant analysed), unchecked."""
    mechanism.check()
    check_delta(delta)
    chosen = get_accountant(accountant)
    analysed = mechanism
    while not isinstance(analysed, chosen.analyses):
        analysed = analysed.reduced()
        if analysed is None:
            raise UserError(f"the {accountant} accountant cannot analyse a {mechanism.kind}")
    result = chosen.epsilon(analysed, float(delta))
    if analysed is not mechanism:
        result = replace(result, details={**result.details, "reduced_from": mechanism.record()})
    return result, analysed


def check_not_below_lower_bound(
    accountant: str, result: EpsilonResult, analysed: MechanismDescription, delta: float
) -> None:
    """UserError when an accountant's ε of a Poisson-subsampled Gaussian lies below a proven
    lower bound on it (prv.lower_bound): the accountant under-reports ε, and the noise it
    calibrates would not meet the budget, yet every re-accounting by the same code would agree.
    The built-in accountants are upper bounds, each tested against the others. The bound lies
    max(0.05, 0.5% of RDP's ε) under the true ε or more (prv.FLOOR_EPS_ERROR): it catches gross
    under-reporting, not a slip of a few hundredths. Unchecked: other descriptions (a BandMF's ε
    has no lower bound here) and where PRV cannot run even one step (tiny noise; a δ so small,
    ~1e-18, that its grid fails)."""
    if type(analysed) is not SampledGaussian:
        return
    floor = prv.lower_bound(analysed, delta)
    if floor is None or result.epsilon >= floor[0]:
        return
    lower, steps = floor
    raise UserError(
        f"accountant {accountant!r} ({ACCOUNTANTS.origin_of_unshipped(accountant)}) gives ε ="
        f" {result.epsilon:.4g} for {analysed} at δ = {delta:g}, below {lower:.4g}, a proven lower"
        f" bound on that mechanism's ε (prv_accountant's lower bound at {steps} steps): it"
        " under-reports ε, and noise calibrated by it would not meet the budget"
    )


def clear_cache() -> None:
    for a in ACCOUNTANTS.values():
        a.epsilon.cache_clear()
    prv.lower_bound.cache_clear()


def calibrate_noise(
    target_epsilon: float,
    mechanism: Callable[[float], MechanismDescription],
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Smallest noise multiplier z (to relative tolerance Z_RTOL) with epsilon(mechanism(z)) <=
    target, for a family of descriptions `mechanism(z)` whose epsilon falls as z grows.

    Bisection in log z; the returned z is always one whose epsilon was computed and found
    <= target, and a plug-in accountant's ε at it is checked once (`compute_epsilon`).
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise UserError(f"target epsilon must be finite and > 0, got {target_epsilon}")
    mechanism(1.0).check()
    check_delta(delta)
    get_accountant(accountant, calibrating_only=True)

    def fits(z: float) -> bool:  # unchecked: the search's end is checked once, below
        return _accounted(mechanism(z), delta, accountant)[0].epsilon <= target_epsilon

    # The others are at most the RDP epsilon, so the RDP answer brackets theirs from above,
    # where RDP reaches the target: its largest order bounds its ε below whatever the noise.
    hi = 1.0
    if accountant != "rdp":
        try:
            hi = calibrate_noise(target_epsilon, mechanism, delta, "rdp")
        except UserError:
            hi = 1.0
    lo = hi
    if fits(hi):
        while lo > Z_MIN and fits(lo):
            hi, lo = lo, lo / 2
    else:
        while not fits(hi):
            if hi >= Z_MAX:
                described = mechanism(hi)
                reached = _accounted(described, delta, accountant)[0].epsilon
                why = (
                    f"; RDP's largest order ({max(rdp.RDP_ORDERS):g}) bounds its ε from below"
                    " whatever the noise: the pld or prv accountant certifies smaller ones"
                    if accountant == "rdp"
                    else ""
                )
                raise UserError(
                    f"epsilon {target_epsilon} at delta {delta} is out of the {accountant}"
                    f" accountant's reach: at noise multiplier {Z_MAX:g} it gives {reached:.4g}"
                    f" (q={described.sampling_rate}, T={described.steps}){why}"
                )
            lo, hi = hi, hi * 2
    while hi / lo - 1 > Z_RTOL:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    compute_epsilon(mechanism(hi), delta, accountant)
    return hi
