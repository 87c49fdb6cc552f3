"""Gradient-based layer freezing (paper 003, Algorithm 1).

Seed (public) training accumulates each tensor's squared gradient norm Σ_t ‖g_{t,h}‖² over all of
its steps (central.train_step; the raw gradients, before clipping). A tensor's score is that sum
per dimension (/d_h). Walking the tensors from the highest score down, the "top" set takes each
one while the set still holds at most `percent`% of all parameters and stops at the first that
would overshoot (as 003: the set may be empty). The run then trains either that set or the rest.
Frozen tensors are neither updated nor noised, and per-layer clipping spreads its budget over the
trained tensors only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pflbench.errors import UserError
from pflbench.spec.models import LayerFreeze


def layer_scores(grad_sq_sums: dict[str, float], sizes: dict[str, int]) -> dict[str, float]:
    """Σ_t ‖∂L/∂θ_h‖² divided by θ_h's size, per named parameter."""
    return {name: grad_sq_sums[name] / sizes[name] for name in sizes}


def select_trained(
    scores: dict[str, float],
    sizes: dict[str, int],
    percent: float,
    train: Literal["top", "bottom"],
) -> list[str]:
    """Names to train: the top-scoring tensors holding at most `percent`% of all parameters, or
    the rest. Ties are broken by name for determinism."""
    ranked = sorted(scores, key=lambda n: (-scores[n], n))
    total = sum(sizes.values())
    budget = percent / 100 * total
    top: list[str] = []
    held = 0
    for name in ranked:
        if held + sizes[name] > budget:
            break
        top.append(name)
        held += sizes[name]
    if train == "top" and not top:
        first = ranked[0]
        raise UserError(
            f"layer freezing: the top-scoring tensor {first} alone holds"
            f" {100 * sizes[first] / total:.3g}% of the parameters, more than train_percent ="
            f" {percent:g}%, so nothing would be trained; raise train_percent"
        )
    chosen = set(top) if train == "top" else set(ranked) - set(top)
    return [n for n in scores if n in chosen]


def trained_tensors(
    freeze: LayerFreeze | None, sizes: dict[str, int], seed_path: Path | None, task: str
) -> list[str]:
    """All parameter names (`sizes`, in model order), or those layer freezing leaves trainable,
    scored by the squared gradients the seed training accumulated (stored beside the seed
    model's checkpoint)."""
    if freeze is None:
        return list(sizes)
    if seed_path is None:
        raise UserError(f"task {task!r} has no seed data, whose training layer freezing ranks by")
    meta = json.loads(seed_path.with_suffix(".json").read_text())  # checkpoint.meta_path
    sums = meta["training"]["layer_grad_sq_sums"]
    if not any(sums.values()):
        raise UserError(
            f"layer freezing: the seed model {seed_path} saw no gradients (central.steps ="
            f" {meta['recipe']['central']['steps']}), so there are no scores to rank layers by"
        )
    return select_trained(layer_scores(sums, sizes), sizes, freeze.train_percent, freeze.train)
