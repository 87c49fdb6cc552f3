"""Gaussian noise for user-level DP, from random streams keyed by (run seed, central step[, user]).

Keying the stream (instead of drawing from one global generator) makes the noise independent of
the number of processes and of the order in which users are processed.

Placement: "server" adds N(0, (C*sigma_dp)^2) once to the averaged update; "client" adds
N(0, C^2 sigma_dp^2 qK) to each user's update before averaging by the expected cohort qK. The
average then has the same noise distribution: qK * C^2 sigma_dp^2 qK / (qK)^2 = (C*sigma_dp)^2.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor


def stream_seed(seed: int, step: int, user: int | str | None = None) -> int:
    """64-bit seed of the stream for one central step (server) or one user at one step (client)."""
    domain = "server" if user is None else f"user/{user}"
    key = f"pflbench/noise/{domain}/seed={seed}/step={step}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def noise_generator(
    seed: int, step: int, user: int | str | None = None, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A fresh generator for the keyed stream. CPU and CUDA generators give different streams."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed, step, user))
    return generator


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


def client_noise_std(clip_bound: float, sigma_dp: float, expected_cohort: float) -> float:
    """Std of the noise each user adds before the sum is divided by the expected cohort qK."""
    return clip_bound * sigma_dp * math.sqrt(expected_cohort)
