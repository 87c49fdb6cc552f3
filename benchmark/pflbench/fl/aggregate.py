"""Streaming aggregation of client updates for one central step.

Per client: zero a non-finite update (counted), clip it (none / global / per-layer), add
client-side noise if that placement is chosen, and add it to an exact fixed-point sum. At the end
of the step the sums are all-reduced across processes, divided by the expected cohort qK (Poisson)
or S (fixed), and server-side noise N(0, (C·σ_DP)²) is added once. Client-side noise (std
C·σ_DP·√S per user) gives the average std C·σ_DP only when exactly S users took part, so it needs
fixed-size cohorts: the recipe refuses it with Poisson sampling, and `finish` refuses a step
whose client count differs from the denominator. Memory is one sum buffer of the model's size,
whatever the cohort; the fixed-point sum makes the result bitwise independent of client order and
of the number of processes. The small stats tensor stays on the CPU (it is all-reduced over gloo,
see fl.distributed).
"""

from __future__ import annotations

import torch

from pflbench.fl.distributed import all_reduce_sum
from pflbench.privacy.aggregate import ExactSum
from pflbench.privacy.clipping import clip_update, zero_if_nonfinite
from pflbench.privacy.noise import (
    add_gaussian_noise,
    client_noise_std,
    noise_generator,
    server_noise_std,
)
from pflbench.spec.models import PrivacyRecipe

NOISE_HEADROOM = 40.0  # client-side noise is bounded by C + 40 std in the fixed-point sum


class StepAggregator:
    """Accumulates one central step's client updates; `finish` returns the pseudo-gradient."""

    def __init__(
        self,
        like: dict[str, torch.Tensor],
        privacy: PrivacyRecipe,
        sigma_dp: float,
        denominator: float,
        update_bound: float,
        seed: int,
        step: int,
        device: str,
    ):
        self.names = list(like)
        self.privacy, self.sigma_dp, self.denominator = privacy, sigma_dp, denominator
        self.seed, self.step, self.device = seed, step, device
        clipped = privacy.clipping != "none"
        self.clip_bound = privacy.clip_bound if clipped else update_bound
        self.client_std = 0.0
        if sigma_dp > 0 and privacy.noise_placement == "client":
            self.client_std = client_noise_std(privacy.clip_bound, sigma_dp, denominator)
        self.sum = ExactSum(like, max_abs=self.clip_bound + NOISE_HEADROOM * self.client_std)
        num_layers = len(self.names)
        # clients, non-finite, clipped, loss sum, local steps, frames, then Σ‖Δ_h‖ and Σ‖Δ_h‖².
        self.stats = torch.zeros(6 + 2 * num_layers, dtype=torch.float64)

    def add(
        self, update: dict[str, torch.Tensor], user: str, loss: float, steps: int, frames: int
    ) -> None:
        """Fold one client's Δ in (the update's buffers are modified in place)."""
        nonfinite = zero_if_nonfinite(update)
        clipped = clip_update(
            update,
            self.privacy.clipping,
            self.privacy.clip_bound,
            perlayer_mode=self.privacy.perlayer_mode,
            in_place=True,
            perlayer_rule=self.privacy.perlayer_rule,
        )
        if self.client_std:
            generator = noise_generator(self.seed, self.step, user=user, device=self.device)
            add_gaussian_noise(clipped.update, self.client_std, generator)
        self.sum.add(clipped.update)
        norms = clipped.norms.double().cpu()
        loss = 0.0 if nonfinite else loss
        head = [1.0, float(nonfinite), float(clipped.changed), loss, steps, frames]
        self.stats += torch.cat([torch.tensor(head, dtype=torch.float64), norms, norms**2])

    def finish(self) -> tuple[list[torch.Tensor], dict]:
        """All-reduce, average, add server noise; returns (pseudo-gradient per tensor, stats)."""
        all_reduce_sum(self.sum.buffers())
        all_reduce_sum([self.stats])
        clients = float(self.stats[0])
        if self.client_std and clients != self.denominator:
            raise ValueError(
                f"client-side noise needs exactly {self.denominator:g} clients per step (then the"
                f" average's noise std is C·σ_DP), got {clients:g}: use fixed-size cohorts"
            )
        averaged = self.sum.result(torch.float32)
        grads = [averaged[n].div_(self.denominator) for n in self.names]
        # With client-side noise the noiseless average never exists anywhere.
        norm_before = None if self.client_std else _global_norm(grads)
        if self.sigma_dp > 0 and self.privacy.noise_placement == "server":
            std = server_noise_std(self.privacy.clip_bound, self.sigma_dp)
            generator = noise_generator(self.seed, self.step, device=self.device)
            add_gaussian_noise(dict(zip(self.names, grads, strict=True)), std, generator)
        return grads, self._report(norm_before, _global_norm(grads))

    def _report(self, norm_before: float | None, norm_after: float) -> dict:
        clients, nonfinite, clipped, loss_sum, steps, frames = self.stats[:6].tolist()
        h = len(self.names)
        n = max(clients, 1.0)
        mean = self.stats[6 : 6 + h] / n
        std = (self.stats[6 + h :] / n - mean**2).clamp_min(0).sqrt()
        finite = clients - nonfinite
        return {
            "clients": int(clients),
            "nonfinite_updates": int(nonfinite),
            "loss": loss_sum / finite if finite else float("nan"),
            "local_steps": int(steps),
            "frames": int(frames),
            "diagnostics": {
                "private": False,
                "layer_norm_mean": dict(zip(self.names, mean.tolist(), strict=True)),
                "layer_norm_std": dict(zip(self.names, std.tolist(), strict=True)),
                "clipped_fraction": clipped / n if clients else None,
                "update_norm_before_noise": norm_before,
                "update_norm_after_noise": norm_after,
            },
        }


def _global_norm(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))
