"""Example-level DP-SGD's per-example clipping, exact: opacus' DPOptimizer (accumulation over
chunks, noise, scaling by B) with each example's gradient clipped by pflbench's own rule
(privacy.clipping.clip_examples) instead of opacus'.

Opacus scales example i by C/(‖g_i‖ + 1e-6) with ‖g_i‖ measured in fp32 and sums the products
in one einsum, so its bound holds only up to fp32 rounding: an fp32 norm of d values is off by up
to ~d·2^-24 relative, values under ~1e-23 square to zero and over ~1e19 to Inf in it, and the
einsum never stores example i's scaled gradient (with TF32 matmuls on, CUDA would even round g_i
to 10 bits first), so its contribution has no fp32 value whose norm could be bounded. Here, per
chunk of examples:

1. Each example's norm per tensor is measured in fp64 (`example_norms`: exact squares), its
   factors are `clip_factors`' (the user-level rule and rounding margin, clipping.py: global
   (1 - margin)·C/‖g_i‖ where ‖g_i‖ may exceed C; per layer (1 - margin)·C_h/‖g_i,h‖ with
   `layer_bounds`' C_h, Σ C_h² = C²), and its rows of each per-example gradient are scaled in
   place, in the parameter's dtype (the accumulation dtype; opacus' cast). clipping.py's argument
   then holds for each example as for one user's update: its scaled gradient c_i as stored has
   ‖c_i‖ ≤ C (global) or ‖c_i,h‖ ≤ C_h for every tensor h (per layer, so ‖c_i‖ ≤ C too), in
   exact arithmetic. An example holding a NaN/Inf becomes zeros (counted: `last_clip`).
2. Σ_i c_i is summed exactly: each stored c_i goes onto a fixed-point grid (a power-of-two
   step, as the user-level sum's, privacy.aggregate.ExactSum: quantizing a clipped value keeps it
   within its bound) and the integers are summed in int64. opacus' noise N(0, z²C²), the same
   draws from the step's generator, joins that sum on its grid, and only the total is rounded,
   to the parameter's dtype, then divided by B (`max_grad_norm` is C itself, also per layer,
   where opacus' DPPerLayerOptimizer would take the fp32 norm of the fp32-rounded C_h).

The released gradient is then a rounding of the exact Σ c_i plus noise, a post-processing of the
Gaussian mechanism. Summed in floating point before the noise, it would not be: how a sum rounds
depends on the other examples, so one example could move the release by slightly more than C.
The Gaussian is still sampled in floating point (opacus' secure_mode addresses that; unused here,
as in the user-level path).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import (
    _check_processed_flag,
    _generate_noise,
    _mark_as_processed,
)
from torch.optim import Optimizer

from pflbench.privacy.aggregate import INT_BUDGET_BITS
from pflbench.privacy.clipping import ExampleClip, clip_examples

# How many standard deviations a noise draw may reach (the sum's grid leaves room for it); a
# Gaussian draw beyond 40 has probability ~1e-349, below any float.
NOISE_SIGMAS = 40.0


class ExactClipDPOptimizer(DPOptimizer):
    """opacus' DPOptimizer with each example's gradient clipped exactly, globally to C or per
    tensor to C_h (`perlayer_mode`'s allocation over the optimizer's trained tensors); the noise
    has std z·C. `last_clip`: what the latest clipping did (factors, NaN/Inf examples zeroed)."""

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        clipping: Literal["global", "perlayer"],
        clip_bound: float,
        perlayer_mode: Literal["uniform", "dim"],
        noise_multiplier: float,
        expected_batch_size: int,
        max_examples: int,
        loss_reduction: Literal["mean", "sum"] = "mean",
    ):
        """`max_examples`: a bound on the examples of one step (the dataset's size, under
        Poisson sampling): with the noise's headroom it fixes the sum's grid."""
        if clipping not in ("global", "perlayer"):
            raise ValueError(f"unknown clipping {clipping!r}; expected global or perlayer")
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=clip_bound,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
        )
        self.clipping = clipping
        self.perlayer_mode = perlayer_mode
        self.last_clip: ExampleClip | None = None
        # Every element of a clipped example is at most C; the noise's at most NOISE_SIGMAS
        # standard deviations (a draw beyond is refused in add_noise, never wrapped around).
        largest_sum = (max_examples + NOISE_SIGMAS * noise_multiplier) * clip_bound
        self.grid = 2.0 ** math.floor(math.log2(2.0**INT_BUDGET_BITS / largest_sum))

    def clip_and_accumulate(self) -> None:
        """Clip each example's per-example gradients in place and add their sum to summed_grad
        (opacus' contract: the per-example gradients are marked processed)."""
        samples = []
        for p in self.params:
            _check_processed_flag(p.grad_sample)
            # In the parameter's dtype, as opacus accumulates (a bf16 one is cast exactly).
            samples.append(self._get_flat_grad_sample(p).to(p.dtype))
        self.last_clip = clip_examples(
            samples, self.clipping, self.max_grad_norm, self.perlayer_mode
        )
        for p, sample in zip(self.params, samples, strict=True):
            contributions = self._on_grid(sample).sum(dim=0)  # int64: exact
            if p.summed_grad is None:
                p.summed_grad = contributions
            else:
                p.summed_grad += contributions
            _mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        """p.grad = the exact sum plus opacus' noise (its draws in the parameter's dtype, from
        the step's generator), on the sum's grid, rounded once to the parameter's dtype."""
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            like = torch.empty(p.summed_grad.shape, dtype=p.dtype, device=p.device)
            noise = _generate_noise(std, like, self.generator, self.secure_mode)
            largest = float(torch.linalg.vector_norm(noise, float("inf"))) if noise.numel() else 0.0
            if not largest <= NOISE_SIGMAS * std:  # (NaN too)
                raise ValueError(f"a noise draw beyond {NOISE_SIGMAS:g} standard deviations")
            total = p.summed_grad + self._on_grid(noise)
            p.grad = total.to(torch.float64).div_(self.grid).to(p.dtype).view_as(p)
            _mark_as_processed(p.summed_grad)

    def _on_grid(self, values: torch.Tensor) -> torch.Tensor:
        """values·grid (exact: a power of two) rounded to int64 integers: half to even for
        fp32/bf16/fp16 values (only those under 2^24 grid steps, ~(N + 40z)·C·2^-38, are off the
        grid, and rounding them grows a norm by far less than clipping's margin, as in ExactSum),
        toward zero for fp64 ones (no such slack)."""
        scaled = values.to(torch.float64).mul_(self.grid)
        scaled = scaled.trunc_() if values.dtype == torch.float64 else scaled.round_()
        return scaled.to(torch.int64)
