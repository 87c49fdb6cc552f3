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
2. summed_grad += Σ_i c_i, the stored c_i summed in the parameter's dtype; opacus then adds
   N(0, z²C²) from the step's generator (`max_grad_norm` is C itself, also per layer, where
   opacus' DPPerLayerOptimizer would take the fp32 norm of the fp32-rounded C_h) and divides by B.

What the sensitivity argument needs is the released value to be a post-processing of the exact
Σ c_i plus noise, each c_i within C. Here it is not quite: the fp32 sum rounds each partial sum
(by ~2^-24 relative of the sum, not of one example's share) *before* opacus adds the noise, and
how a sum rounds depends on the other examples, so one example can move the release by slightly
more than C (the user-level mechanism adds its noise onto its exact sum instead,
fl.aggregate/ExactSum.add_noise; this path does not yet). The Gaussian is also sampled in
floating point (opacus' secure_mode addresses that; unused here, as in the user-level path).
"""

from __future__ import annotations

from typing import Literal

from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch.optim import Optimizer

from pflbench.privacy.clipping import ExampleClip, clip_examples


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
        loss_reduction: Literal["mean", "sum"] = "mean",
    ):
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
            contributions = sample.sum(dim=0)
            if p.summed_grad is None:
                p.summed_grad = contributions
            else:
                p.summed_grad += contributions
            _mark_as_processed(p.grad_sample)
