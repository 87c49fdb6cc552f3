"""Streaming aggregation of client updates for one central step.

Per client: zero a non-finite update (counted), clip it (none / global / per-layer), add
client-side noise if that placement is chosen, and add it to an exact fixed-point sum. At the end
of the step the sums are all-reduced across processes, divided by the expected cohort qK (Poisson)
or S (fixed), and server-side noise N(0, (C·σ_DP)²) is added once. With adaptive clipping C is
the step's bound C_t, the update noise is C_t·σ_Δ, and the noised fraction of users within C_t
is released for the next bound (privacy/adaptive.py). Client-side noise (std
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
from pflbench.privacy.adaptive import noisy_unclipped_fraction, update_noise
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
HEAD = 7  # per-step counters ahead of the per-layer norm sums in the stats tensor


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
        clip_bound: float | None = None,
    ):
        """`clip_bound`: this step's bound C_t under adaptive clipping (else the recipe's C)."""
        self.names = list(like)
        self.privacy, self.sigma_dp, self.denominator = privacy, sigma_dp, denominator
        self.seed, self.step, self.device = seed, step, device
        self.bound = privacy.clip_bound if clip_bound is None else clip_bound
        clipped = privacy.clipping != "none"
        self.max_norm = self.bound if clipped else update_bound
        self.client_std = 0.0
        if sigma_dp > 0 and privacy.noise_placement == "client":
            self.client_std = client_noise_std(self.bound, sigma_dp, denominator)
        self.sum = ExactSum(like, max_abs=self.max_norm + NOISE_HEADROOM * self.client_std)
        num_layers = len(self.names)
        # clients, non-finite, clipped, loss sum, local steps, frames, within the bound, then
        # Σ‖Δ_h‖ and Σ‖Δ_h‖².
        self.stats = torch.zeros(HEAD + 2 * num_layers, dtype=torch.float64)
        self.canaries = torch.zeros(1, dtype=torch.float64)  # audit canaries: users without data

    def add(
        self, update: dict[str, torch.Tensor], user: str, loss: float, steps: int, frames: int
    ) -> None:
        """Fold one client's Δ in (the update's buffers are modified in place)."""
        nonfinite = zero_if_nonfinite(update)
        clipped = self._fold(update, user)
        norms = clipped.norms.double().cpu()
        loss = 0.0 if nonfinite else loss
        within = _within(norms, self.bound)  # the adaptive bit
        head = [1.0, float(nonfinite), float(clipped.changed), loss, steps, frames, float(within)]
        self.stats += torch.cat([torch.tensor(head, dtype=torch.float64), norms, norms**2])

    def add_canary(self, update: dict[str, torch.Tensor], user: str) -> None:
        """Fold an audit canary's Δ in like a user's (privacy/audit.py), adaptive bit included;
        it has no data, so it stays out of the training stats."""
        clipped = self._fold(update, user)
        self.canaries += 1
        self.stats[6] += float(_within(clipped.norms.double().cpu(), self.bound))

    def _fold(self, update: dict[str, torch.Tensor], user: str):
        """Clip, add client-side noise if placed there, and add to the exact sum."""
        clipped = clip_update(
            update,
            self.privacy.clipping,
            self.bound,
            perlayer_mode=self.privacy.perlayer_mode,
            in_place=True,
            perlayer_rule=self.privacy.perlayer_rule,
        )
        if self.client_std:
            generator = noise_generator(self.seed, self.step, user=user, device=self.device)
            add_gaussian_noise(clipped.update, self.client_std, generator)
        self.sum.add(clipped.update)
        return clipped

    def finish(self) -> tuple[list[torch.Tensor], dict]:
        """All-reduce, average, add server noise; returns (pseudo-gradient per tensor, stats)."""
        all_reduce_sum(self.sum.buffers())
        all_reduce_sum([self.stats, self.canaries])
        clients = float(self.stats[0] + self.canaries[0])
        if self.client_std and clients != self.denominator:
            raise ValueError(
                f"client-side noise needs exactly {self.denominator:g} clients per step (then the"
                f" average's noise std is C·σ_DP), got {clients:g}: use fixed-size cohorts"
            )
        averaged = self.sum.result(torch.float32)
        grads = [averaged[n].div_(self.denominator) for n in self.names]
        # With client-side noise the noiseless average never exists anywhere.
        norm_before = None if self.client_std else _global_norm(grads)
        adaptive = self.privacy.adaptive_clip
        bit_noise = adaptive.bit_noise if adaptive is not None and self.sigma_dp > 0 else 0.0
        if self.sigma_dp > 0 and self.privacy.noise_placement == "server":
            sigma = update_noise(self.sigma_dp, bit_noise) if bit_noise else self.sigma_dp
            generator = noise_generator(self.seed, self.step, device=self.device)
            add_gaussian_noise(
                dict(zip(self.names, grads, strict=True)),
                server_noise_std(self.bound, sigma),
                generator,
            )
        report = self._report(norm_before, _global_norm(grads))
        if adaptive is not None:
            generator = noise_generator(self.seed, self.step, user="adaptive-clip")
            within = float(self.stats[6])
            report["clip_bound"] = self.bound
            report["unclipped_fraction"] = noisy_unclipped_fraction(
                within, self.denominator, bit_noise, generator
            )  # DP-released: the next bound is computed from it
        return grads, report

    def _report(self, norm_before: float | None, norm_after: float) -> dict:
        clients, nonfinite, clipped, loss_sum, steps, frames, _ = self.stats[:HEAD].tolist()
        h = len(self.names)
        n = max(clients, 1.0)
        mean = self.stats[HEAD : HEAD + h] / n
        std = (self.stats[HEAD + h :] / n - mean**2).clamp_min(0).sqrt()
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


def _within(norms: torch.Tensor, bound: float) -> bool:
    return float(torch.linalg.vector_norm(norms)) <= bound


def _global_norm(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))
