"""Streaming aggregation of client updates for one central step.

Per client: the run's privacy mechanism (privacy/mechanisms) constrains the update's sensitivity
(zero a non-finite update, clip it to C_t, client-side noise if placed there) and the result goes
into an exact fixed-point sum. At the end of the step the sums are all-reduced across processes,
the mechanism's noise on the average, times its denominator (the expected cohort), is added to
the exact sum before anything is rounded (ExactSum.add_noise), the result is divided by the
denominator, and the mechanism releases what it releases beside the average (adaptive
clipping's fraction of users within C_t). The aggregator itself keeps only the exact sum and
named statistics. Memory is one sum buffer of the model's size, whatever the cohort; the
fixed-point sum makes the result bitwise independent of client order and of the number of
processes. The small stats tensor stays on the CPU (it is all-reduced over gloo, see
fl.distributed).
"""

from __future__ import annotations

import time

import torch

from pflbench.fl.distributed import all_reduce_sum, one_process
from pflbench.privacy.aggregate import ExactSum
from pflbench.privacy.mechanisms import (
    PrivacyMechanism,
    check_noise_on_average,
    check_within_clip_bound,
    checks_plugin_bound,
    scales_in_sum,
)

# The stats tensor: HEAD per-step counters (clients, non-finite, clipped, loss sum, local steps,
# frames, within the bound, audit canaries), then Σ‖Δ_h‖ and Σ‖Δ_h‖² per layer.
HEAD = 8
WITHIN, CANARIES = 6, 7


class StepAggregator:
    """Accumulates one central step's client updates; `finish` returns the pseudo-gradient."""

    def __init__(
        self,
        like: dict[str, torch.Tensor],
        mechanism: PrivacyMechanism,
        step: int,
        update_bound: float,
        workspace: ExactSum | None = None,
    ):
        """`update_bound`: the largest element of an unclipped update (or payload).
        `workspace`: an earlier step's ended sum (of the same tensors) to sum into again."""
        self.like = like
        self.names = list(like)
        self.mechanism, self.step = mechanism, step
        self.bound = mechanism.clip_bound  # C_t
        self.check_bound = checks_plugin_bound(mechanism)  # a plug-in's, under DP
        self.scale_in_sum = scales_in_sum(mechanism)  # clipping's multiply in the sum's pass
        max_abs = mechanism.largest_element(update_bound)
        if workspace is None:
            self.sum = ExactSum(like, max_abs=max_abs)
        else:
            workspace.restart(max_abs)
            self.sum = workspace
        num_layers = len(self.names)
        # The counters are Python floats (fp64 sums like a tensor's, without a tensor op per
        # client); they join the norm sums in one stats tensor at the end (HEAD).
        self.head = [0.0] * HEAD
        self.norm_sums = torch.zeros(num_layers, dtype=torch.float64)
        self.norm_squares = torch.zeros(num_layers, dtype=torch.float64)
        self.seconds = 0.0  # in the per-user privacy steps and the sum (`pflbench bench fl`)

    def add(
        self,
        update: dict[str, torch.Tensor],
        user: str,
        loss: float,
        steps: int,
        frames: int,
        held: int = 0,
    ) -> None:
        """Fold one client's Δ in (the update's buffers are modified in place, and may be left
        unclipped: clipping's multiply can be the sum's, ExactSum.add). `held`: the caller keeps
        them unchanged through that many more adds and until `finish` (ExactSum.add's)."""
        facts = self._fold(update, user, held)
        norms = facts["norms"].double().cpu()
        nonfinite = facts["nonfinite"]
        loss = 0.0 if nonfinite else loss
        within = float(facts["within"])  # the adaptive bit
        head = [1.0, float(nonfinite), float(facts["clipped"]), loss, steps, frames, within, 0.0]
        self.head = [total + value for total, value in zip(self.head, head, strict=True)]
        self.norm_sums += norms
        self.norm_squares += norms**2

    def add_canary(self, update: dict[str, torch.Tensor], user: str) -> None:
        """Fold an audit canary's Δ in like a user's (privacy/audit.py): the same privacy steps,
        adaptive bit included; it has no data, so it stays out of the training stats. It sends
        no payload beyond Δ: the algorithm's entries are zeros."""
        update = {
            n: update[n] if n in update else torch.zeros_like(t) for n, t in self.like.items()
        }
        facts = self._fold(update, user)
        self.head[WITHIN] += float(facts["within"])
        self.head[CANARIES] += 1.0  # audit canaries: users without data

    def _fold(self, update: dict[str, torch.Tensor], user: str, held: int = 0) -> dict:
        """Constrain the update's sensitivity and add the result to the exact sum; returns what
        the mechanism saw of it (privacy/steps.py)."""
        started = time.perf_counter()
        # (an override of constrain_sensitivity need not take the keyword)
        options = {"scale_in_sum": True} if self.scale_in_sum else {}
        facts = self.mechanism.constrain_sensitivity(update, user, self.step, **options)
        if self.check_bound:  # measured by pflbench, not as the plug-in reports it
            facts["largest"] = check_within_clip_bound(self.mechanism, update, user, self.step)
        self.sum.add(update, facts.get("largest"), facts.get("pending"), held)
        if "client_noise" in facts:  # a term of its own (privacy.steps.AddClientNoise)
            self.sum.add(facts["client_noise"])
        self.seconds += time.perf_counter() - started
        return facts

    def finish(self) -> tuple[list[torch.Tensor], dict]:
        """All-reduce, average, noise; returns (pseudo-gradient per tensor, stats). The
        mechanism's releases beside the average join the stats (and move its C_t)."""
        if not one_process():  # one process's sum is final: no int64 buffer (ExactSum.result)
            all_reduce_sum(self.sum.buffers())
        head = torch.tensor(self.head, dtype=torch.float64)
        stats = torch.cat([head, self.norm_sums, self.norm_squares])
        all_reduce_sum([stats])
        mechanism = self.mechanism
        participants = float(stats[0]) + float(stats[CANARIES])
        mechanism.check_clients(participants)
        # With client-side noise the noiseless average never exists anywhere.
        norm_before = None if mechanism.client_noise else self.sum.norm() / mechanism.denominator
        if mechanism.noises_average:  # onto the exact sum, before anything is rounded
            noise = self.sum.noise_buffers()
            mechanism.add_noise(noise, self.step)
            if self.check_bound:  # a plug-in's, under DP: measured, as its updates are
                check_noise_on_average(mechanism, noise, self.step)
            self.sum.add_noise(mechanism.denominator)
        averaged = self.sum.result(torch.float32)
        grads = [averaged[n].div_(mechanism.denominator) for n in self.names]
        report = self._report(stats, norm_before, _global_norm(grads))
        report |= mechanism.end_step(float(stats[WITHIN]), participants, self.step)
        return grads, report

    def _report(self, stats: torch.Tensor, norm_before: float | None, norm_after: float) -> dict:
        """`stats`: the all-reduced stats tensor (HEAD)."""
        clients, nonfinite, clipped, loss_sum, steps, frames = stats[:WITHIN].tolist()
        h = len(self.names)
        n = max(clients, 1.0)
        mean = stats[HEAD : HEAD + h] / n
        std = (stats[HEAD + h :] / n - mean**2).clamp_min(0).sqrt()
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
