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
  their squares cannot underflow. On a CPU fp32 layers are measured by a C kernel (_kernels.c) in
  the order torch sums them, so the norms are torch's bit for bit, in one read of the update
  (torch first writes its fp64 copy): 0.8 against 4-12 ms for a 4.89M-element update.
- A scaled layer aims at (1 - margin)·bound, where the margin (`rounding_margin`) covers that
  measurement error, the factor's and the product's rounding and the result's rounding into the
  tensor's dtype (eps + 2^-22 + (d + H + 16)·2^-53 relative; 3.6e-7 for fp32).
- That relative margin cannot cover values that land in a dtype's subnormal range, where rounding
  is absolute. A layer whose bound is that small (below sqrt(d)·tiny: fp16 below ~0.09 for a
  2.36M-element layer; fp32/bf16 only below ~1e-35) is scaled in fp64 and rounded toward zero, so
  no element grows (`_scale_toward_zero`). So is a layer whose fp32 factor would itself be
  subnormal (an update over ~1e38·C, near fp32's largest values), where the factor's own rounding
  is absolute.

The same rule clips each example's gradient in example-level DP-SGD (`clip_examples`, through
opacus' optimizer in privacy/example_optimizer.py): `clip_factors` takes the fp64 norms of one
update [H] or of n examples [n, H] alike, and each example's values are scaled as a layer is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Literal

import torch
from torch import Tensor

try:  # the fp64 norms of fp32 layers in one pass (module docstring); without it, torch's
    from pflbench.privacy import _kernels
except ImportError:
    _kernels = None

UNIT_ROUNDOFF_64 = 2.0**-53


@dataclass
class ClipResult:
    update: dict[str, Tensor]  # clipped (same dtypes/devices as input)
    norms: Tensor  # fp64 [H] per-layer L2 norms before clipping (order = dict order)
    factors: Tensor  # fp64 [H] factor applied per layer (> 1 only for scaled-up "normalize")
    total_norm: float  # global L2 norm before clipping
    # fp64 [H]: where clip_update(scale=False) left each tensor's multiply to the caller, its
    # factor (`apply_factors`), else 1; None where every tensor holds its clipped values.
    pending: Tensor | None = None

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
    if _kernel_measures(tensors):
        return _kernel_layer_norms(tensors)
    norms = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    narrow = [i for i, t in enumerate(tensors) if t.dtype != torch.float64]
    if narrow:
        measured = torch._foreach_norm([tensors[i] for i in narrow], 2, dtype=torch.float64)
        norms[narrow] = torch.stack(measured)
    for i, t in enumerate(tensors):
        if t.dtype == torch.float64:
            norms[i] = _fp64_norms(t.reshape(1, -1))[0]
    return norms


def _kernel_measures(tensors: Sequence[Tensor]) -> bool:
    """Whether the C kernel measures these tensors as torch does: contiguous fp32 CPU tensors
    (torch sums a strided one in the order of its memory, not of its elements), where the kernel
    sums in torch's order."""
    return (
        all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)
        and kernel_norms_are_torchs()
    )


def _kernel_layer_norms(tensors: Sequence[Tensor]) -> Tensor:
    """`layer_norms` of contiguous fp32 CPU tensors by the C kernel."""
    norms = torch.empty(len(tensors), dtype=torch.float64)
    addresses, sizes = [t.data_ptr() for t in tensors], [t.numel() for t in tensors]
    _kernels.layer_norms(addresses, sizes, norms.data_ptr())
    return norms


@cache
def kernel_norms_are_torchs() -> bool:
    """Whether the C kernel is built and sums in torch's order here, checked once per process on
    probes whose norms' last bits depend on that order (a torch version or CPU architecture that
    sums otherwise gets torch's norms, not the kernel's)."""
    if _kernels is None:
        return False
    probes = order_probes()
    torchs = torch.stack(torch._foreach_norm(probes, 2, dtype=torch.float64))
    return torch.equal(_kernel_layer_norms(probes), torchs)


def order_probes() -> list[Tensor]:
    """fp32 tensors whose fp64 norms' last bits change when their squares are summed in another
    order: magnitudes spread over 2^±16 (2^±32 squared), three of each length 1 to 39 (every
    remainder modulo the kernel's 4 lanes, tails as large as the rest: orders that treat the tail
    otherwise differ on some) and four longer ones, up to 65,539 elements."""
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(n, generator=generator) * torch.randn(n, generator=generator).mul(8).exp2()
        for n in [*range(1, 40), *range(1, 40), *range(1, 40), 1001, 1002, 4099, 65539]
    ]


def fast_layer_norms(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor] | None:
    """fp64 [H] L2 norm of each fp32 tensor measured in fp32 (one fused kernel, ~6x cheaper than
    torch's fp64 norms on a CPU), and a bound on each one's relative error: whatever the order of
    the sum, (numel + 16) fp32 roundings (Higham's γ_n, doubled to cover the sqrt). For what needs
    no exact norm (statistics, a range bound); None where a tensor is not fp32 or so large that the
    bound would not be small. Inf/NaN where a tensor holds one, and also where the fp32 squares
    overflow: `layer_norms` tells these apart."""
    numels = tuple(t.numel() for t in tensors)
    if not tensors or any(t.dtype != torch.float32 for t in tensors) or max(numels) > 2**21:
        return None
    norms = torch.stack(torch._foreach_norm(list(tensors), 2)).double()
    return norms, _fp32_norm_errors(numels, norms.device)


@cache
def _fp32_norm_errors(numels: tuple[int, ...], device: torch.device) -> Tensor:
    # The same shapes every client: made once, not per update (read only).
    return torch.tensor(
        [2 * (n + 16) * 2.0**-24 for n in numels], dtype=torch.float64, device=device
    )


def example_norms(grad_samples: Sequence[Tensor]) -> Tensor:
    """fp64 [n, H]: the L2 norm of each of n examples' values in each of H tensors [n, ...],
    measured as `layer_norms` measures a layer (exact squares in fp64; NaN/Inf where an example's
    values hold a NaN/Inf)."""
    columns = []
    for sample in grad_samples:
        flat = sample.reshape(len(sample), sample.shape[1:].numel())
        if sample.dtype == torch.float64:
            columns.append(_fp64_norms(flat))
        else:  # each value cast to fp64 before it is squared
            columns.append(torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64))
    return torch.stack(columns, dim=1)


def _fp64_norms(rows: Tensor) -> Tensor:
    """fp64 [n]: the L2 norm of each row of an fp64 [n, d], each row divided by its largest
    element so that no square underflows; a row holding an Inf/NaN gives NaN."""
    if rows.shape[1] == 0:
        return rows.new_zeros(len(rows))
    largest = rows.abs().amax(dim=1)
    # (`largest == 0` is False for a NaN: the norm is NaN, as it must be.)
    divisor = torch.where(largest == 0, 1.0, largest)
    return largest * torch.linalg.vector_norm(rows / divisor[:, None], dim=1)


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
    scale: bool = True,
) -> ClipResult:
    """Clip `update` to L2 norm `bound` (global) or per layer to C_h by `perlayer_rule`.

    Layers left alone are returned unchanged (factor exactly 1). Call `zero_if_nonfinite`
    first: a NaN/Inf update has no meaningful norm. `norms`: the update's `layer_norms`, where
    already measured. `scale=False` (in place only) leaves the plain multiplies (`apply_factors`)
    to the caller, in `pending`: the exact sum takes them in its own pass over the update.
    """
    if not (scale or in_place):
        raise ValueError("clip_update(scale=False) needs in_place=True")
    if not update:
        raise ValueError("clip_update needs a non-empty update")
    tensors = list(update.values())
    norms = layer_norms(tensors) if norms is None else norms
    sizes, dtypes = tuple(t.numel() for t in tensors), tuple(t.dtype for t in tensors)
    factors = clip_factors(norms, sizes, dtypes, clipping, bound, perlayer_mode, perlayer_rule)
    out = tensors if in_place else [t.clone() for t in tensors]
    pending = None
    if clipping != "none":
        relative = _bounds_round_relatively(sizes, dtypes, clipping, bound, perlayer_mode)
        pending = _scale(out, factors, relative)
        if scale:
            apply_factors(out, pending)
            pending = None
    return ClipResult(
        update=dict(zip(update.keys(), out, strict=True)),
        norms=norms,
        factors=factors,
        total_norm=float(torch.linalg.vector_norm(norms)),
        pending=pending,
    )


def clip_factors(
    norms: Tensor,
    sizes: Sequence[int],
    dtypes: Sequence[torch.dtype],
    clipping: Literal["none", "global", "perlayer"],
    bound: float,
    perlayer_mode: Literal["uniform", "dim"] = "dim",
    perlayer_rule: Literal["clip", "normalize"] = "clip",
) -> Tensor:
    """The factor each layer of an update is scaled by, fp64 like `norms`: [H] for one update
    (its `layer_norms`), [n, H] for n examples (`example_norms`). `sizes` and `dtypes`: each
    layer's number of values and dtype (of one example), which its rounding margin depends on.
    A factor is exactly 1 where the layer is left alone."""
    if not bound > 0:
        raise ValueError(f"clip bound must be > 0, got {bound}")
    if perlayer_rule not in ("clip", "normalize"):
        raise ValueError(f"unknown per-layer rule {perlayer_rule!r}; expected clip or normalize")
    margin_list, errors = _margins_and_errors(tuple(sizes), tuple(dtypes))
    total_norm = torch.linalg.vector_norm(norms, dim=-1, keepdim=True)
    # A norm measured within its error of the bound may be over it: such a layer is clipped too.
    over_total = total_norm > bound * (1 - max(errors))
    if clipping == "none":
        return torch.ones_like(norms)
    if clipping == "global":
        # (A tensor divides a Python number by multiplying with its reciprocal: one more rounding.)
        aim = torch.full_like(total_norm, (1 - max(margin_list)) * bound)
        scale = aim / total_norm.clamp_min(1e-300)
        return torch.where(over_total, scale, 1.0).expand_as(norms).clone()
    if clipping == "perlayer":
        bounds = layer_bounds(sizes, bound, perlayer_mode).to(norms.device)
        margins = torch.tensor(margin_list, dtype=torch.float64, device=norms.device)
        aims = (1 - margins) * bounds / norms.clamp_min(1e-300)
        if perlayer_rule == "clip":
            tolerance = 1 - torch.tensor(errors, dtype=torch.float64, device=norms.device)
            return torch.where(norms > bounds * tolerance, aims, 1.0)
        # normalize: where the total is over C, every non-zero layer to (1 - margin) * C_h
        return torch.where(over_total & (norms > 0), aims, 1.0)
    raise ValueError(f"unknown clipping {clipping!r}; expected none, global or perlayer")


@cache
def _margins_and_errors(
    sizes: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> tuple[list[float], list[float]]:
    """Each layer's `rounding_margin` and `measurement_error` (the same shapes every client: made
    once, not per update; read only)."""
    layers = len(sizes)
    margins = [rounding_margin(d, size, layers) for d, size in zip(dtypes, sizes, strict=True)]
    return margins, [measurement_error(size, layers) for size in sizes]


def scaled_bounds(
    sizes: Sequence[int],
    clipping: Literal["global", "perlayer"],
    bound: float,
    perlayer_mode: Literal["uniform", "dim"] = "dim",
) -> list[tuple[float, int]]:
    """Per layer, the bound its scaled values must keep and over how many values rounding adds
    up against it: (C, all values) for every layer under global clipping (subnormal rounding adds
    up over the whole update against the one bound C), (C_h, d_h) per layer."""
    if clipping == "global":
        return [(bound, sum(sizes))] * len(sizes)
    return list(zip(layer_bounds(sizes, bound, perlayer_mode).tolist(), sizes, strict=True))


@dataclass
class ExampleClip:
    factors: Tensor  # fp64 [n, H] factor applied to each example's layer (0: a NaN/Inf example)
    nonfinite: Tensor  # bool [n]: the examples zeroed for holding a NaN/Inf

    @property
    def clipped(self) -> int:
        """How many finite examples clipping scaled down (some layer's factor below 1)."""
        return int(((self.factors < 1).any(dim=1) & ~self.nonfinite).sum())


def clip_examples(
    grad_samples: Sequence[Tensor],
    clipping: Literal["global", "perlayer"],
    bound: float,
    perlayer_mode: Literal["uniform", "dim"] = "dim",
) -> ExampleClip:
    """Clip each of n examples' gradients in place: H tensors [n, ...], row i example i's values
    of that layer; globally to ‖g_i‖ ≤ C or per layer ("clip" rule) to ‖g_i,h‖ ≤ C_h, exactly as
    `clip_update` clips one update (norms in fp64, the same factors and margins; rows in a
    dtype's subnormal range, or whose fp32 factor is subnormal, scaled in fp64 and rounded toward
    zero). An example holding a NaN/Inf becomes zeros, inside every bound."""
    if not grad_samples:
        raise ValueError("clip_examples needs at least one tensor")
    sizes = [sample.shape[1:].numel() for sample in grad_samples]
    norms = example_norms(grad_samples)
    nonfinite = ~torch.isfinite(norms).all(dim=1)
    factors = clip_factors(
        norms.masked_fill(nonfinite[:, None], 0.0),
        sizes,
        [sample.dtype for sample in grad_samples],
        clipping,
        bound,
        perlayer_mode,
    )
    factors[nonfinite] = 0.0
    targets = scaled_bounds(sizes, clipping, bound, perlayer_mode)
    # Per tensor: are all its factors 1, and does each multiply round relatively (as fp32; as
    # fp64)? With whether any example is zeroed: one transfer from the device for all tensors.
    flags = torch.cat([
        ((factors == 1).all(dim=0)),
        _factors_round_relatively(factors, torch.float32).all(dim=0),
        _factors_round_relatively(factors, torch.float64).all(dim=0),
        nonfinite.any()[None],
    ]).tolist()  # fmt: skip
    layers = len(grad_samples)
    untouched, relative32, relative64 = (flags[i * layers : (i + 1) * layers] for i in range(3))
    for h, (sample, (layer_bound, size)) in enumerate(zip(grad_samples, targets, strict=True)):
        rows = (-1, *[1] * (sample.ndim - 1))
        if flags[-1]:  # (0 times an Inf is NaN: the NaN/Inf examples are zeroed, not scaled)
            sample.masked_fill_(nonfinite.view(rows), 0.0)
        if untouched[h]:
            continue
        column = factors[:, h].view(rows)
        wide = sample.dtype == torch.float64
        if _bound_rounds_relatively(layer_bound, size, sample.dtype) and (
            relative64[h] if wide else relative32[h]
        ):
            sample.mul_(column if wide else column.float())
        else:
            _scale_toward_zero(sample, column)
    return ExampleClip(factors=factors, nonfinite=nonfinite)


@lru_cache(maxsize=16)  # (adaptive clipping moves the bound each step: a few kept, not all)
def _bounds_round_relatively(
    sizes: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    clipping: Literal["global", "perlayer"],
    bound: float,
    perlayer_mode: Literal["uniform", "dim"],
) -> tuple[bool, ...]:
    """Per layer of an update, `_bound_rounds_relatively` for its target in `scaled_bounds` (the
    same shapes every client: found once, not per update)."""
    targets = scaled_bounds(sizes, clipping, bound, perlayer_mode)
    return tuple(
        _bound_rounds_relatively(layer_bound, size, dtype)
        for (layer_bound, size), dtype in zip(targets, dtypes, strict=True)
    )


def _bound_rounds_relatively(bound: float, size: int, dtype: torch.dtype) -> bool:
    """Whether `size` values of `dtype` scaled to within `bound` round within its relative
    margin: the values' own rounding in the subnormal range (absolute, up to tiny·eps/2 each)
    adds up to at most that (bound >= sqrt(size)·tiny)."""
    return bound >= math.sqrt(size) * torch.finfo(dtype).tiny


def _factors_round_relatively(factors: float | Tensor, dtype: torch.dtype) -> bool | Tensor:
    """Elementwise (a number or fp64 factors): whether multiplying values of `dtype` by the
    factor, as fp32 (fp64 for fp64 values), rounds relatively: the factor is exact (1, or 0 for
    zeroed examples) or normal in that dtype (a subnormal fp32 factor, which scales an update
    over ~1e38·C, is itself rounded absolutely, by up to 2^-150)."""
    kind = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    return (factors == 1) | (factors == 0) | ((factors >= kind.tiny) & (factors < kind.max))


def _scale(tensors: list[Tensor], factors: Tensor, relative: Sequence[bool]) -> Tensor:
    """Prepare to multiply each tensor by its factor where that is not 1, the result within its
    target bound exactly; returns the factors of the plain multiplies still to do
    (`apply_factors`; 1 elsewhere). `relative`: per tensor, whether its target's rounding is
    relative (`_bounds_round_relatively`).

    Where rounding is relative, and so is the factor's (`_factors_round_relatively`): a plain
    multiply. Elsewhere rounding is absolute: the product is taken here, in fp64 and rounded
    toward zero, so no element grows."""
    toward_zero: list[int] = []
    factor_rounds: dict[tuple[float, torch.dtype], bool] = {}  # (one factor for all, globally)
    for i, (factor, bound_rounds) in enumerate(zip(factors.tolist(), relative, strict=True)):
        if factor == 1.0:
            continue
        tensor = tensors[i]
        key = (factor, tensor.dtype)
        if key not in factor_rounds:
            factor_rounds[key] = _factors_round_relatively(factor, tensor.dtype)
        if not (bound_rounds and factor_rounds[key]):
            _scale_toward_zero(tensor, factor)
            toward_zero.append(i)
    if not toward_zero:
        return factors
    pending = factors.clone()
    pending[toward_zero] = 1.0
    return pending


def apply_factors(tensors: list[Tensor], factors: Tensor) -> None:
    """tensors[h] *= factors[h] (fp64 [H]) in place where the factor is not 1, in one fused
    multiply by fp32 factor tensors (fp64 for fp64 tensors; a Python scalar would first be rounded
    to a half-precision tensor's dtype, and overflow fp16 when a small layer is scaled up): the
    product rounds relatively where `_scale` left the multiply, and the C kernel of the exact sum
    (privacy/aggregate.py) takes the same products."""
    multiplied = [h for h, factor in enumerate(factors.tolist()) if factor != 1.0]
    if multiplied:
        as32 = factors.float()
        torch._foreach_mul_(
            [tensors[h] for h in multiplied],
            [factors[h] if tensors[h].dtype == torch.float64 else as32[h] for h in multiplied],
        )


def _scale_toward_zero(tensor: Tensor, factor: float | Tensor) -> None:
    """tensor *= factor (a number, or fp64 factors broadcast over it) in place: the product
    taken in fp64 and rounded toward zero into the tensor's dtype, so that no value grows past
    the exact product. fp64 tensors have no wider dtype: refused."""
    if tensor.dtype == torch.float64:
        raise ValueError(
            "an fp64 tensor cannot be clipped exactly where its bound is below fp64's normal"
            " range or its factor is subnormal"
        )
    exact = tensor.double() * factor
    rounded = exact.to(tensor.dtype)
    away = rounded.double().abs() > exact.abs()
    toward_zero = torch.nextafter(rounded, torch.zeros_like(rounded))
    tensor.copy_(torch.where(away, toward_zero, rounded))


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
