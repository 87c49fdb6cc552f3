"""What an accountant is: a name, how it is described, the library it pins, and one function.

Every accountant analyses the Poisson-subsampled Gaussian mechanism with noise multiplier z (the
Gaussian std relative to the L2 sensitivity, the clip bound C) at sampling rate q, composed over
T steps, under the add-or-remove-one-user neighbouring relation. `pflbench.privacy.accountants`
is the registry of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


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
    details: dict = field(default_factory=dict)  # how it was computed (orders, discretization)


@dataclass(frozen=True)
class Accountant:
    name: str  # the key in records, budgets and on the command line
    description: str  # how a privacy statement names it
    library: str  # the Python package that computes it; records carry its version
    # epsilon(z, q, T, delta) for already validated arguments, lru-cached; raises UserError where
    # the accountant cannot compute epsilon (the statement then records the reason).
    epsilon: Callable[[float, float, int, float], EpsilonResult]
    # One line on how a result was computed (from its details), for `privacy epsilon`'s table.
    summary: Callable[[dict], str]
    # Whether a budget may name it: it then calibrates z and its epsilon is the record's claim.
    calibrates: bool
