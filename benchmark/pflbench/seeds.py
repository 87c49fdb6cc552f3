"""Keyed random streams: every random choice in pflbench (seed-model batches and draws, cohorts,
client batches and augmentation, variational and DP noise, canaries) comes from a generator
seeded by a key tuple such as (run seed, central step, user, "client").

Keying each stream, instead of drawing from one global generator, makes the draws independent of
the number of processes, of the order in which users are trained and of resumption. Keys are
hashed with their repr, so they must be built from ints and strings (stable across runs, machines
and Python versions). This module is the one place that turns keys into seeds.
"""

from __future__ import annotations

import hashlib

import torch


def keyed_seed(*key: int | str) -> int:
    """A 63-bit seed from a key tuple: independent streams per key."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def keyed_generator(*key: int | str, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh generator on `device` seeded by the key (CPU and CUDA generators give different
    streams for one seed)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(keyed_seed(*key))
    return generator


def seed_global_draws(seed: int, device: str | torch.device) -> None:
    """Seed the global generators that the model's own draws (dropout, CAPE, layer drop) use on
    `device`: the CPU's and, on CUDA, every GPU's, as `torch.manual_seed` does. Called per
    client, so not `torch.manual_seed` itself: it also records a stack trace for CUDA's lazy
    seeding, ~1 ms a call in the trainer's deep stack."""
    torch.default_generator.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(seed)  # CUDA is initialized here: seeded now, no trace
