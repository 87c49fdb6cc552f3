"""Clipping a user's model update (name -> tensor) to an L2 bound C: globally or per layer.

A layer is one named parameter tensor. Per-layer bounds C_h satisfy sum_h C_h^2 = C^2, so a
per-layer clipped update also has ||update|| <= C and the DP sensitivity is unchanged. Two
per-layer rules: "clip" scales each layer to min(||update_h||, C_h) (paper 002, Definition 3);
"normalize" (the paper authors' code) leaves an update with ||update|| <= C alone and otherwise
rescales every non-zero layer to exactly C_h, scaling small layers up.

The bound is what the accountant assumes, so it holds exactly, measured in exact arithmetic, for
fp32, bf16, fp16 and fp64 updates of any size, not only up to rounding:
- Norms are accumulated in fp64 (`layer_norms`). The square of an fp32/bf16/fp16 element is exact
  in fp64, so a layer of d elements is measured within (d - 1)·2^-53 relative, whatever the
  summation order (fp32 accumulation under-measures a 2.36M-element layer by ~4e-5, and squares
  under ~1e-23 vanish in it). fp64 tensors are measured divided by their largest element, so that
  their squares cannot underflow.
- A scaled layer aims at (1 - margin)·bound, where the margin (`rounding_margin`) covers that
  measurement error, the factor's and the product's rounding and the result's rounding into the
  tensor's dtype (eps + 2^-22 + (d + H + 16)·2^-53 relative; 3.6e-7 for fp32).
- That relative margin cannot cover values that land in a dtype's subnormal range, where rounding
  is absolute. A layer whose bound is that small (below sqrt(d)·tiny: fp16 below ~0.09 for a
  2.36M-element layer; fp32/bf16 only below ~1e-35) is scaled in fp64 and rounded toward zero, so
  no element grows (`_scale_toward_zero`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

UNIT_ROUNDOFF_64 = 2.0**-53
FP32_MAX = torch.finfo(torch.float32).max


@dataclass
class ClipResult:
    update: dict[str, Tensor]  # clipped (same dtypes/devices as input)
    norms: Tensor  # fp64 [H] per-layer L2 norms before clipping (order = dict order)
    factors: Tensor  # fp64 [H] factor applied per layer (> 1 only for scaled-up "normalize")
    total_norm: float  # global L2 norm before clipping

    @property
    def changed(self) -> bool:
        """Whether clipping changed the update (any layer's factor is not exactly 1)."""
        return bool((self.factors != 1).any())


def layer_bounds(sizes: Sequence[int], bound: float, mode: Literal["uniform", "dim"]) -> Tensor:
    """Per-layer bounds C_h: C/sqrt(H) ("uniform") or C*sqrt(d_h / sum d) ("dim"), fp64 [H]."""
    if len(sizes) == 0:
        raise ValueError("layer_bounds needs at least one layer")
    sizes64 = torch.tensor(sizes, dtype=torch.float64)
    if mode == "uniform":
        return torch.full_like(sizes64, bound / math.sqrt(len(sizes)))
    if mode == "dim":
        return bound * torch.sqrt(sizes64 / sizes64.sum())
    raise ValueError(f"unknown per-layer mode {mode!r}; expected 'uniform' or 'dim'")


def layer_norms(tensors: Sequence[Tensor]) -> Tensor:
    """fp64 [H] L2 norm of each tensor, accumulated in fp64 (one fused kernel for all tensors
    that are not fp64). NaN or Inf exactly where a tensor holds a NaN or an Inf: the squares of
    finite fp32/bf16/fp16 values cannot overflow fp64."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    device = tensors[0].device
    norms = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    narrow = [i for i, t in enumerate(tensors) if t.dtype != torch.float64]
    if narrow:
        measured = torch._foreach_norm([tensors[i] for i in narrow], 2, dtype=torch.float64)
        norms[narrow] = torch.stack(measured)
    for i, t in enumerate(tensors):
        if t.dtype == torch.float64 and t.numel():
            # Divided by the largest element, no square underflows; an Inf/NaN gives NaN.
            largest = t.abs().max()
            # (`largest == 0` is False for a NaN: the norm is NaN, as it must be.)
            norms[i] = 0.0 if largest == 0 else largest * torch.linalg.vector_norm(t / largest)
    return norms


def measurement_error(numel: int, layers: int) -> float:
    """Relative error bound of a layer's fp64 norm (numel exact squares summed in any order), and
    of the total over `layers` such norms."""
    return (numel + layers + 16) * UNIT_ROUNDOFF_64


def rounding_margin(dtype: torch.dtype, numel: int, layers: int) -> float:
    """Relative shrink of a scaled layer's target below its bound: the dtype's rounding of the
    result (eps/2), the fp32 factor's and the fp32 product's rounding (2^-24 each, inside 2^-22),
    and the norms' measurement error."""
    return torch.finfo(dtype).eps + 2.0**-22 + measurement_error(numel, layers)


def clip_update(
    update: dict[str, Tensor],
    clipping: Literal["none", "global", "perlayer"],
    bound: float,
    perlayer_mode: Literal["uniform", "dim"] = "dim",
    in_place: bool = False,
    perlayer_rule: Literal["clip", "normalize"] = "clip",
    norms: Tensor | None = None,
) -> ClipResult:
    """Clip `update` to L2 norm `bound` (global) or per layer to C_h by `perlayer_rule`.

    Layers left alone are returned unchanged (factor exactly 1). Call `zero_if_nonfinite`
    first: a NaN/Inf update has no meaningful norm. `norms`: the update's `layer_norms`, where
    already measured.
    """
    if not update:
        raise ValueError("clip_update needs a non-empty update")
    if not bound > 0:
        raise ValueError(f"clip bound must be > 0, got {bound}")
    if perlayer_rule not in ("clip", "normalize"):
        raise ValueError(f"unknown per-layer rule {perlayer_rule!r}; expected clip or normalize")
    tensors = list(update.values())
    norms = layer_norms(tensors) if norms is None else norms
    total_norm = float(torch.linalg.vector_norm(norms))
    margins = torch.tensor(
        [rounding_margin(t.dtype, t.numel(), len(tensors)) for t in tensors],
        dtype=torch.float64,
        device=norms.device,
    )
    # A norm measured within its error of the bound may be over it: such a layer is clipped too.
    errors = [measurement_error(t.numel(), len(tensors)) for t in tensors]
    over_total = total_norm > bound * (1 - max(errors))
    if clipping == "none":
        factors = torch.ones_like(norms)
        targets = None
    elif clipping == "global":
        scale = (1 - float(margins.max())) * bound / max(total_norm, 1e-300)
        factors = torch.full_like(norms, scale if over_total else 1.0)
        # Subnormal rounding adds up over all elements against the one bound C.
        total_size = sum(t.numel() for t in tensors)
        targets = [(bound, total_size)] * len(tensors)
    elif clipping == "perlayer":
        bounds = layer_bounds([t.numel() for t in tensors], bound, perlayer_mode).to(norms.device)
        aims = (1 - margins) * bounds / norms.clamp_min(1e-300)
        if perlayer_rule == "clip":
            tolerance = 1 - torch.tensor(errors, dtype=torch.float64, device=norms.device)
            factors = torch.where(norms > bounds * tolerance, aims, 1.0)
        elif over_total:  # normalize: every non-zero layer to (1 - margin) * C_h
            factors = torch.where(norms > 0, aims, 1.0)
        else:
            factors = torch.ones_like(norms)
        targets = list(zip(bounds.tolist(), (t.numel() for t in tensors), strict=True))
    else:
        raise ValueError(f"unknown clipping {clipping!r}; expected none, global or perlayer")

    out = tensors if in_place else [t.clone() for t in tensors]
    if targets is not None:
        _scale(out, factors, targets)
    return ClipResult(
        update=dict(zip(update.keys(), out, strict=True)),
        norms=norms,
        factors=factors,
        total_norm=total_norm,
    )


def _scale(tensors: list[Tensor], factors: Tensor, targets: list[tuple[float, int]]) -> None:
    """Multiply each tensor in place by its factor where that is not 1, the result within its
    target bound (over the given number of elements) exactly.

    In a dtype's normal range rounding is relative and inside the margin: one fused multiply by
    fp32 factor tensors (fp64 for fp64 tensors; a Python scalar would first be rounded to a
    half-precision tensor's dtype, and overflow fp16 when a small layer is scaled up). Where a
    bound is so small that elements can be subnormal (bound < sqrt(size)·tiny), rounding is
    absolute: there the product is taken in fp64 and rounded toward zero, so no element grows."""
    fast: list[int] = []
    for i, (factor, (bound, size)) in enumerate(zip(factors.tolist(), targets, strict=True)):
        if factor == 1.0:
            continue
        tensor = tensors[i]
        # (A factor past fp32's range scales a subnormal layer up: that takes the fp64 path too.)
        if bound >= math.sqrt(size) * torch.finfo(tensor.dtype).tiny and (
            tensor.dtype == torch.float64 or factor < FP32_MAX
        ):
            fast.append(i)
        elif tensor.dtype == torch.float64:
            raise ValueError(f"clip bound {bound} is below fp64's normal range for {size} values")
        else:
            exact = tensor.double() * factor
            rounded = exact.to(tensor.dtype)
            away = rounded.double().abs() > exact.abs()
            toward_zero = torch.nextafter(rounded, torch.zeros_like(rounded))
            tensor.copy_(torch.where(away, toward_zero, rounded))
    if fast:
        as32 = factors.float()
        torch._foreach_mul_(
            [tensors[i] for i in fast],
            [factors[i] if tensors[i].dtype == torch.float64 else as32[i] for i in fast],
        )


def zero_if_nonfinite(update: dict[str, Tensor], norms: Tensor | None = None) -> bool:
    """Zero the whole update in place if any element is NaN/Inf; return whether it was.
    `norms`: the update's `layer_norms` where already measured (they are NaN/Inf exactly where
    the update holds a NaN/Inf, so the check costs no pass of its own).

    A zero update is inside every clipping bound, so replacing a broken user keeps DP intact.
    """
    tensors = list(update.values())
    norms = layer_norms(tensors) if norms is None else norms
    if bool(torch.isfinite(norms).all()):
        return False
    torch._foreach_zero_(tensors)
    return True
