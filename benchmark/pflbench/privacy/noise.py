"""Gaussian noise for user-level DP, from random streams keyed by (run seed, central step[, user]).

Keying the stream (instead of drawing from one global generator) makes the noise independent of
the number of processes and of the order in which users are processed.

Placement: "server" adds N(0, (C*sigma_dp)^2) once to the averaged update; "client" adds
N(0, C^2 sigma_dp^2 S) to each user's update before the sum is divided by S. With exactly S users
(fixed-size cohorts) the average has the same noise: S * C^2 sigma_dp^2 S / S^2 = (C*sigma_dp)^2.
With Poisson sampling it would not: |K_t| users and the divisor qK give C^2 sigma_dp^2 |K_t| / qK,
too little noise whenever fewer than qK users are sampled (none for an empty cohort), so client
placement is refused unless sampling is fixed (spec.models.Recipe, fl.aggregate.StepAggregator).

The streams are seeded from the run seed for reproducibility (a run and its resume draw the same
noise). That makes the noise predictable to anyone who knows the seed: a deployment must draw it
from a secret seed (or a cryptographically secure generator) and sample cohorts with a secure
sampler; pflbench simulates, it does not deploy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pflbench.seeds import keyed_generator


def noise_generator(
    seed: int, step: int, user: int | str | None = None, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A fresh generator for the noise of one central step (server) or of one user at one step
    (client). CPU and CUDA generators give different streams."""
    who = ("server",) if user is None else ("user", user)
    return keyed_generator(seed, step, "noise", *who, device=device)


def release_generator(seed: int, step: int, release: str) -> torch.Generator:
    """A fresh CPU generator for the noise of a named release beside the average at one step
    (adaptive clipping's count): keyed apart from the server's and every user's streams."""
    return keyed_generator(seed, step, "noise", release)


def add_gaussian_noise(update: dict[str, Tensor], std: float, generator: torch.Generator) -> None:
    """Add N(0, std^2) to every element in place; drawn in fp32 per tensor in dict order, so the
    draw does not depend on the update's dtype."""
    if not std >= 0 or math.isinf(std):
        raise ValueError(f"noise std must be finite and >= 0, got {std}")
    for tensor in update.values():
        noise = torch.randn(
            tensor.shape, generator=generator, dtype=torch.float32, device=tensor.device
        )
        tensor.add_(noise, alpha=std)


def server_noise_std(clip_bound: float, sigma_dp: float) -> float:
    """Std of the noise added once to the averaged update."""
    return clip_bound * sigma_dp


def client_noise_std(clip_bound: float, sigma_dp: float, cohort: float) -> float:
    """Std of the noise each user adds before the sum is divided by the cohort size S; right
    only when exactly S users take part (fixed-size cohorts)."""
    return clip_bound * sigma_dp * math.sqrt(cohort)
