"""Cohort sampling and the keyed random streams every random choice of a run draws from.

Each stream is keyed by (seed, step, user, purpose), so a choice never depends on how many
processes run, in which order clients train, or whether the run was resumed.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch


def keyed_seed(*key: object) -> int:
    """A 63-bit seed derived from a key tuple (stable across runs, machines and Python versions)."""
    digest = hashlib.sha256(repr(tuple(key)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def keyed_generator(*key: object, device: str | torch.device = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(keyed_seed(*key))
    return generator


def sampling_rate(population: int, cohort_size: int) -> float:
    """q = S/K (capped at 1): the Poisson rate the accountant assumes."""
    return min(1.0, cohort_size / population)


def expected_cohort(population: int, cohort_size: int) -> float:
    """qK: the denominator of the averaged update for Poisson sampling (S for fixed sampling)."""
    return sampling_rate(population, cohort_size) * population


def sample_cohort(
    population: int,
    cohort_size: int,
    sampling: Literal["poisson", "fixed"],
    seed: int,
    step: int,
) -> torch.Tensor:
    """Indices (sorted, int64) of the users taking part in central step `step`.

    Poisson: each user independently with probability q = S/K (the cohort size varies).
    Fixed: exactly min(S, K) users without replacement.
    """
    generator = keyed_generator(seed, step, "cohort")
    if sampling == "poisson":
        q = sampling_rate(population, cohort_size)
        chosen = torch.rand(population, generator=generator) < q
        return chosen.nonzero().flatten()
    if sampling == "fixed":
        order = torch.randperm(population, generator=generator)
        return order[: min(cohort_size, population)].sort().values
    raise ValueError(f"unknown sampling {sampling!r}")
