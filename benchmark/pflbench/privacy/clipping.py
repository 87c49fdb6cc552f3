"""Clipping a user's model update (name -> tensor) to an L2 bound C: globally or per layer.

A layer is one named parameter tensor. Per-layer bounds C_h satisfy sum_h C_h^2 = C^2, so a
per-layer clipped update also has ||update|| <= C and the DP sensitivity is unchanged. Two
per-layer rules: "clip" scales each layer to min(||update_h||, C_h) (paper 002, Definition 3);
"normalize" (the paper authors' code) leaves an update with ||update|| <= C alone and otherwise
rescales every non-zero layer to exactly C_h, scaling small layers up.
Norms are computed in fp32 (fp64 for fp64 tensors) whatever the tensor dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

# Allowance for the fp32 norm itself being rounded: with the dtype's own rounding of the scaled
# values (<= eps/2 relative), a clipped tensor stays inside its bound.
NORM_ROUNDING = 2.0**-23


@dataclass
class ClipResult:
    update: dict[str, Tensor]  # clipped (same dtypes/devices as input)
    norms: Tensor  # fp32 [H] per-layer L2 norms before clipping (order = dict order)
    factors: Tensor  # fp32 [H] factor applied per layer (> 1 only for scaled-up "normalize")
    total_norm: float  # global L2 norm before clipping

    @property
    def changed(self) -> bool:
        """Whether clipping changed the update (any layer's factor is not exactly 1)."""
        return bool((self.factors != 1).any())


def layer_bounds(sizes: Sequence[int], bound: float, mode: Literal["uniform", "dim"]) -> Tensor:
    """Per-layer bounds C_h: C/sqrt(H) ("uniform") or C*sqrt(d_h / sum d) ("dim"), fp32 [H]."""
    if len(sizes) == 0:
        raise ValueError("layer_bounds needs at least one layer")
    sizes64 = torch.tensor(sizes, dtype=torch.float64)
    if mode == "uniform":
        bounds = torch.full_like(sizes64, bound / math.sqrt(len(sizes)))
    elif mode == "dim":
        bounds = bound * torch.sqrt(sizes64 / sizes64.sum())
    else:
        raise ValueError(f"unknown per-layer mode {mode!r}; expected 'uniform' or 'dim'")
    return bounds.to(torch.float32)


def layer_norms(tensors: Sequence[Tensor]) -> Tensor:
    """fp32 [H] L2 norm of each tensor, accumulated in at least fp32 (fp16 squares overflow).
    One fused kernel per accumulation dtype, not one launch per tensor."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(torch.promote_types(t.dtype, torch.float32), []).append(i)
    norms: list[Tensor] = [torch.empty(())] * len(tensors)
    for dtype, index in groups.items():
        group_norms = torch._foreach_norm([tensors[i] for i in index], 2, dtype=dtype)
        for i, norm in zip(index, group_norms, strict=True):
            norms[i] = norm.float()
    return torch.stack(norms)


def rounding_margin(dtype: torch.dtype) -> float:
    """Relative shrink applied to clipped layers so that rounding cannot push them past C_h."""
    return torch.finfo(dtype).eps + NORM_ROUNDING


def _clip_factors(norms: Tensor, bounds: Tensor, margins: Tensor) -> Tensor:
    """Definition 3: shrink each layer over its bound to (1 - margin) * C_h, leave the rest."""
    return torch.where(norms > bounds, (1 - margins) * bounds / norms.clamp_min(1e-30), 1.0)


def _scale(tensors: list[Tensor], factors: Tensor) -> None:
    """Multiply each tensor by its factor where that is not 1. The factors enter as fp32 tensors,
    so half-precision tensors are scaled in fp32 arithmetic: a Python scalar would first be
    rounded to the tensor's dtype (and overflow fp16 when a small layer is scaled up)."""
    index = [i for i, f in enumerate(factors.tolist()) if f != 1.0]
    if index:
        torch._foreach_mul_([tensors[i] for i in index], [factors[i] for i in index])


def clip_update(
    update: dict[str, Tensor],
    clipping: Literal["none", "global", "perlayer"],
    bound: float,
    perlayer_mode: Literal["uniform", "dim"] = "dim",
    in_place: bool = False,
    perlayer_rule: Literal["clip", "normalize"] = "clip",
) -> ClipResult:
    """Clip `update` to L2 norm `bound` (global) or per layer to C_h by `perlayer_rule`.

    Layers left alone are returned unchanged (factor exactly 1). Call `zero_if_nonfinite`
    first: a NaN/Inf update has no meaningful norm.
    """
    if not update:
        raise ValueError("clip_update needs a non-empty update")
    if not bound > 0:
        raise ValueError(f"clip bound must be > 0, got {bound}")
    if perlayer_rule not in ("clip", "normalize"):
        raise ValueError(f"unknown per-layer rule {perlayer_rule!r}; expected clip or normalize")
    tensors = list(update.values())
    norms = layer_norms(tensors)
    total_norm = float(torch.linalg.vector_norm(norms.double()))
    margins = torch.tensor([rounding_margin(t.dtype) for t in tensors], device=norms.device)
    bounds = None
    if clipping == "none":
        factors = torch.ones_like(norms)
    elif clipping == "global":
        scale = (1 - margins.max()) * bound / max(total_norm, 1e-300)
        factors = torch.full_like(norms, float(scale) if total_norm > bound else 1.0)
    elif clipping == "perlayer":
        bounds = layer_bounds([t.numel() for t in tensors], bound, perlayer_mode).to(norms.device)
        if perlayer_rule == "clip":
            factors = _clip_factors(norms, bounds, margins)
        elif total_norm > bound:  # normalize: every non-zero layer to (1 - margin) * C_h
            factors = torch.where(norms > 0, (1 - margins) * bounds / norms.clamp_min(1e-30), 1.0)
        else:
            factors = torch.ones_like(norms)
    else:
        raise ValueError(f"unknown clipping {clipping!r}; expected none, global or perlayer")

    out = tensors if in_place else [t.clone() for t in tensors]
    _scale(out, factors)
    if perlayer_rule == "normalize" and bounds is not None and bool((factors > 1).any()):
        # A layer scaled up was measured on tiny values whose squares can lose precision
        # (subnormals) and so be under-measured: measure the result and clip (Definition 3)
        # any layer that the rescaling pushed past its bound.
        again = _clip_factors(layer_norms(out), bounds, margins)
        _scale(out, again)
        factors = factors * again
    return ClipResult(
        update=dict(zip(update.keys(), out, strict=True)),
        norms=norms,
        factors=factors,
        total_norm=total_norm,
    )


def zero_if_nonfinite(update: dict[str, Tensor]) -> bool:
    """Zero the whole update in place if any element is NaN/Inf; return whether it was.

    A zero update is inside every clipping bound, so replacing a broken user keeps DP intact.
    """
    tensors = list(update.values())
    # The max-abs norm is NaN or Inf exactly when the tensor holds a NaN or an Inf (it is
    # undefined for empty tensors, which hold neither).
    nonempty = [t for t in tensors if t.numel()]
    if not nonempty:
        return False
    finite = torch.isfinite(torch.stack(torch._foreach_norm(nonempty, float("inf")))).all()
    if bool(finite):
        return False
    torch._foreach_zero_(tensors)
    return True
