"""What an accountant is, and what it analyses: mechanism descriptions.

A description is pure data about a mechanism as a whole run (noise, sampling, steps), never a
stateful object: the mechanisms (pflbench.privacy.mechanisms) describe themselves at a scale, and
the accountants (pflbench.privacy.accountants, one module each) turn a description into ε at δ.
An accountant declares the descriptions it analyses; any other description is reduced, by a
theorem that the description names, to one it analyses (a BandMF run to the Poisson-subsampled
Gaussian it is as private as, say), and the result says so.

Every description is under the add-or-remove-one-user neighbouring relation, and its noise
multiplier is the Gaussian noise std relative to the L2 sensitivity of one user's contribution to
the sum (the clip bound C).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from pflbench.errors import UserError


class MechanismDescription(Protocol):
    """What accountants analyse: a frozen dataclass with these fields and methods."""

    kind: ClassVar[str]
    noise_multiplier: float
    sampling_rate: float
    steps: int

    def check(self) -> None:
        """UserError naming the first invalid parameter."""

    def reduced(self) -> MechanismDescription | None:
        """A description this one is at least as private as (None: none)."""

    def record(self) -> dict:
        """JSON-ready: every parameter, and how it reduces."""


@dataclass(frozen=True)
class SampledGaussian:
    """T-fold composition of the Poisson(q)-subsampled Gaussian mechanism with noise multiplier z:
    DP-SGD and DP-FedAvg (paper 002, Algorithm 1)."""

    kind: ClassVar[str] = "sampled-gaussian"
    noise_multiplier: float
    sampling_rate: float
    steps: int

    def __post_init__(self) -> None:  # one cache entry per value, whatever number type came in
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        object.__setattr__(self, "sampling_rate", float(self.sampling_rate))

    def check(self) -> None:
        z, q, steps = self.noise_multiplier, self.sampling_rate, self.steps
        if not (z > 0 and math.isfinite(z)):
            raise UserError(f"noise multiplier must be finite and > 0, got {z}")
        if not 0 < q <= 1:
            raise UserError(f"sampling rate q must be in (0, 1], got {q}")
        if int(steps) != steps or steps < 1:
            raise UserError(f"steps must be an integer >= 1, got {steps}")

    def reduced(self) -> None:
        return None

    def record(self) -> dict:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sampling_rate": self.sampling_rate,
            "steps": self.steps,
        }


# The theorem BandMF descriptions reduce by, as records cite it.
BANDMF_AMPLIFICATION = (
    "Choquette-Choo et al. 2023, (Amplified) Banded Matrix Factorization, Thm. 4: with a b-banded"
    " lower-triangular C and cyclic Poisson participation (users split once into b groups, group"
    " t mod b eligible at step t, each of its users sampled with probability q_b), BandMF is as"
    " private as the Poisson(q_b)-subsampled Gaussian mechanism with noise multiplier"
    " z/max_j||C e_j|| composed over ceil(T/b) steps: one participation's contribution to Cx lies"
    " in column j of C, and the columns of one user's steps have disjoint supports"
)


@dataclass(frozen=True)
class BandMF:
    """BandMF DP-FTRL (Choquette-Choo et al. 2023): the release Cx + z over T steps, C b-banded
    lower-triangular, z_t ~ N(0, (z·C_clip)² I) in the units of the sum, users taking part by
    cyclic Poisson sampling at rate q_b in their group. `column_norm` = max_j ‖C e_j‖ (one
    participation's L2 sensitivity over C_clip), `sensitivity` = max over a user's possible
    participations of ‖C u‖ (all of them at once: what an analysis without amplification uses)."""

    kind: ClassVar[str] = "bandmf"
    noise_multiplier: float
    sampling_rate: float
    steps: int
    bands: int
    column_norm: float
    sensitivity: float
    participation: str = "cyclic Poisson"

    def check(self) -> None:
        q, bands, steps = self.sampling_rate, self.bands, self.steps
        if int(bands) != bands or bands < 1:
            raise UserError(f"BandMF needs an integer number of bands >= 1, got {bands}")
        if int(steps) != steps or steps < 1:
            raise UserError(f"steps must be an integer >= 1, got {steps}")
        if not 0 < q <= 1:
            raise UserError(f"BandMF's sampling rate q_b = b*S/K must be in (0, 1], got {q}")
        if not (self.column_norm > 0 and self.sensitivity >= self.column_norm):
            raise UserError(
                f"BandMF's sensitivities must satisfy 0 < max column norm <= sensitivity, got"
                f" {self.column_norm} and {self.sensitivity}"
            )
        self.reduced().check()

    def reduced(self) -> SampledGaussian:
        """The sampled Gaussian BANDMF_AMPLIFICATION says this run is as private as."""
        rounds = math.ceil(self.steps / self.bands)
        return SampledGaussian(self.noise_multiplier / self.column_norm, self.sampling_rate, rounds)

    def record(self) -> dict:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sampling_rate": self.sampling_rate,
            "steps": self.steps,
            "bands": self.bands,
            "column_norm": self.column_norm,
            "sensitivity": self.sensitivity,
            "participation": self.participation,
            "reduction": BANDMF_AMPLIFICATION,
            "as_sampled_gaussian": self.reduced().record(),
        }


def sampled_gaussian(sampling_rate: float, steps: int) -> Callable[[float], SampledGaussian]:
    """z -> SampledGaussian(z, q, T): the family `calibrate_noise` searches."""
    return functools.partial(SampledGaussian, sampling_rate=sampling_rate, steps=steps)


@dataclass(frozen=True)
class EpsilonResult:
    accountant: str
    library: str
    library_version: str
    epsilon: float
    delta: float
    # The description the accountant analysed (after any reduction: `details["reduced_from"]`).
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
    # epsilon(mechanism, delta) for an already validated description of a kind in `analyses`,
    # lru-cached; raises UserError where the accountant cannot compute epsilon (the statement
    # then records the reason).
    epsilon: Callable[[MechanismDescription, float], EpsilonResult]
    # One line on how a result was computed (from its details), for `privacy epsilon`'s table.
    summary: Callable[[dict], str]
    # Whether a budget may name it: it then calibrates z and its epsilon is the record's claim.
    calibrates: bool
    analyses: tuple[type, ...] = (SampledGaussian,)
    # How closely two machines' ε agree (relative): a filed claim is re-accounted to within it.
    # A closed-form accountant agrees to float rounding; an FFT-based one (PLD, PRV) only to the
    # CPU's FFT rounding, which the discretization amplifies.
    agreement_rtol: float = 1e-9
