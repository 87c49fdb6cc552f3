"""Gradient-based layer freezing (paper 003, Algorithm 1).

Accumulate each tensor's squared gradient norm over warm-up batches of public (seed) data, score
it per dimension (Σ‖g_h‖²/d_h), take the highest-scoring tensors until they hold `percent`% of
the parameters (the "top" set), and train either that set or the rest. Frozen tensors are neither
updated nor noised, and per-layer clipping spreads its budget over the trained tensors only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

import torch

from pflbench.model.transformer import ctc_loss

if TYPE_CHECKING:
    from pflbench.data.batching import Batch


def layer_scores(model: torch.nn.Module, batches: Iterable[Batch], device: str) -> dict[str, float]:
    """Σ over batches of ‖∂L/∂θ_h‖² divided by θ_h's size, per named parameter."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sums = torch.zeros(len(named), dtype=torch.float64)
    model.train()
    for batch in batches:
        model.zero_grad(set_to_none=True)
        log_probs, out_lens = model(batch.feats.to(device), batch.feat_lens.to(device))
        loss = ctc_loss(log_probs, out_lens, batch.targets.to(device), batch.target_lens.to(device))
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in named]
        sums += torch.stack(torch._foreach_norm(grads)).double().cpu() ** 2
    model.zero_grad(set_to_none=True)
    sizes = torch.tensor([p.numel() for _, p in named], dtype=torch.float64)
    return dict(zip([n for n, _ in named], (sums / sizes).tolist(), strict=True))


def select_trained(
    scores: dict[str, float],
    sizes: dict[str, int],
    percent: float,
    train: Literal["top", "bottom"],
) -> list[str]:
    """Names to train: the top-scoring tensors holding `percent`% of all parameters, or the rest.

    The top set always holds at least one tensor; ties are broken by name for determinism."""
    ranked = sorted(scores, key=lambda n: (-scores[n], n))
    budget = percent / 100 * sum(sizes.values())
    top: list[str] = []
    held = 0
    for name in ranked:
        if top and held + sizes[name] > budget:
            break
        top.append(name)
        held += sizes[name]
    chosen = set(top) if train == "top" else set(ranked) - set(top)
    return [n for n in scores if n in chosen]
