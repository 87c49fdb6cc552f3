"""Streaming aggregation of client updates for one central step.

Per client: run the per-user privacy steps (privacy/steps.py: zero a non-finite update, clip it,
add client-side noise if that placement is chosen) and add the result to an exact fixed-point
sum. At the end of the step the sums are all-reduced across processes, divided by the expected
cohort qK (Poisson) or S (fixed), and the aggregate steps run once (server-side noise
N(0, (C·σ_DP)²)). With adaptive clipping C is the step's bound C_t, the update noise is C_t·σ_Δ,
and the noised fraction of users within C_t is released for the next bound (privacy/adaptive.py).
Client-side noise (std C·σ_DP·√S per user) gives the average std C·σ_DP only when exactly S users
took part, so it needs fixed-size cohorts: the recipe refuses it with Poisson sampling, and
`finish` refuses a step whose client count differs from the denominator. Memory is one sum buffer
of the model's size, whatever the cohort; the fixed-point sum makes the result bitwise independent
of client order and of the number of processes. The small stats tensor stays on the CPU (it is
all-reduced over gloo, see fl.distributed).
"""

from __future__ import annotations

import time

import torch

from pflbench.fl.distributed import all_reduce_sum
from pflbench.privacy.aggregate import ExactSum
from pflbench.privacy.steps import privacy_steps
from pflbench.spec.models import PrivacyRecipe

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
        self.like = like
        self.names = list(like)
        self.denominator = denominator
        self.bound = privacy.clip_bound if clip_bound is None else clip_bound
        self.mechanism = privacy_steps(
            privacy, sigma_dp, self.bound, denominator, update_bound, seed, step, device
        )
        self.sum = ExactSum(like, max_abs=self.mechanism.max_abs)
        num_layers = len(self.names)
        # clients, non-finite, clipped, loss sum, local steps, frames, within the bound, then
        # Σ‖Δ_h‖ and Σ‖Δ_h‖².
        self.stats = torch.zeros(HEAD + 2 * num_layers, dtype=torch.float64)
        self.canaries = torch.zeros(1, dtype=torch.float64)  # audit canaries: users without data
        self.seconds = 0.0  # in the per-user privacy steps and the sum (`pflbench bench fl`)

    def add(
        self, update: dict[str, torch.Tensor], user: str, loss: float, steps: int, frames: int
    ) -> None:
        """Fold one client's Δ in (the update's buffers are modified in place)."""
        facts = self._fold(update, user)
        norms = facts["norms"].double().cpu()
        nonfinite = facts["nonfinite"]
        loss = 0.0 if nonfinite else loss
        within = _within(norms, self.bound)  # the adaptive bit
        head = [1.0, float(nonfinite), float(facts["clipped"]), loss, steps, frames, float(within)]
        self.stats += torch.cat([torch.tensor(head, dtype=torch.float64), norms, norms**2])

    def add_canary(self, update: dict[str, torch.Tensor], user: str) -> None:
        """Fold an audit canary's Δ in like a user's (privacy/audit.py): the same privacy steps,
        adaptive bit included; it has no data, so it stays out of the training stats. It sends
        no payload beyond Δ: the algorithm's entries are zeros."""
        update = {
            n: update[n] if n in update else torch.zeros_like(t) for n, t in self.like.items()
        }
        facts = self._fold(update, user)
        self.canaries += 1
        self.stats[6] += float(_within(facts["norms"].double().cpu(), self.bound))

    def _fold(self, update: dict[str, torch.Tensor], user: str) -> dict:
        """Run the per-user privacy steps and add the result to the exact sum; returns what the
        steps saw (privacy/steps.py)."""
        facts: dict = {}
        started = time.perf_counter()
        for user_step in self.mechanism.per_user:
            facts |= user_step.apply(update, user, facts)
        self.sum.add(update, largest=facts.get("largest"))
        self.seconds += time.perf_counter() - started
        return facts

    def finish(self) -> tuple[list[torch.Tensor], dict]:
        """All-reduce, average, run the aggregate privacy steps; returns (pseudo-gradient per
        tensor, stats)."""
        all_reduce_sum(self.sum.buffers())
        all_reduce_sum([self.stats, self.canaries])
        clients = float(self.stats[0] + self.canaries[0])
        if self.mechanism.client_noise and clients != self.denominator:
            raise ValueError(
                f"client-side noise needs exactly {self.denominator:g} clients per step (then the"
                f" average's noise std is C·σ_DP), got {clients:g}: use fixed-size cohorts"
            )
        averaged = self.sum.result(torch.float32)
        grads = [averaged[n].div_(self.denominator) for n in self.names]
        # With client-side noise the noiseless average never exists anywhere.
        norm_before = None if self.mechanism.client_noise else _global_norm(grads)
        for aggregate_step in self.mechanism.aggregate:
            aggregate_step.apply(averaged)  # in place: its tensors are `grads`
        report = self._report(norm_before, _global_norm(grads))
        release = self.mechanism.unclipped_fraction
        if release is not None:
            report["clip_bound"] = self.bound
            # DP-released: the next bound is computed from it.
            report["unclipped_fraction"] = release.apply(float(self.stats[6]))
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
