"""Cohort sampling, from the step's keyed stream (pflbench.seeds), so that a cohort never depends
on how many processes run or whether the run was resumed. In privacy: the sampling is what the
accountant's amplification assumes (q = S/K), and the trainers (pflbench.fl) draw their cohorts
here."""

from __future__ import annotations

import math
from typing import Literal

import torch

from pflbench.seeds import keyed_generator


def sampling_rate(population: int, cohort_size: int) -> float:
    """q = S/K (capped at 1): the Poisson rate the accountant assumes."""
    return min(1.0, cohort_size / population)


# torch.rand's fp32 draws are multiples of 2^-24, so `draw < q` includes a user with probability
# ⌈q·2^24⌉/2^24, above the q the accountant is given unless q·2^24 is whole.
RATE_GRID = 2.0**-24


def poisson_threshold(rate: float) -> float:
    """What a uniform fp32 draw is compared with to include a user with probability at most
    `rate`: `rate` rounded down onto the draws' grid, so the probability is ⌊q·2^24⌋/2^24 ≤ q
    (at most 2^-24 less)."""
    return math.floor(rate / RATE_GRID) * RATE_GRID


def expected_cohort(population: int, cohort_size: int) -> float:
    """The denominator of the averaged update: qK = min(S, K) for Poisson sampling, and the size
    of a fixed cohort. Taken as min(S, K), not q·K, which rounds 1 ulp short for some (S, K)
    (15 of 22): the average's sensitivity C/denominator would exceed the C/S its noise is for."""
    return float(min(cohort_size, population))


def sample_cohort(
    population: int,
    cohort_size: int,
    sampling: Literal["poisson", "fixed"],
    seed: int,
    step: int,
) -> torch.Tensor:
    """Indices (sorted, int64) of the users taking part in central step `step`.

    Poisson: each user independently with probability q = S/K, at most (poisson_threshold; the
    cohort size varies).
    Fixed: exactly min(S, K) users without replacement.
    """
    generator = keyed_generator(seed, step, "cohort")
    if sampling == "poisson":
        q = sampling_rate(population, cohort_size)
        chosen = torch.rand(population, generator=generator) < poisson_threshold(q)
        return chosen.nonzero().flatten()
    if sampling == "fixed":
        order = torch.randperm(population, generator=generator)
        return order[: min(cohort_size, population)].sort().values
    raise ValueError(f"unknown sampling {sampling!r}")
