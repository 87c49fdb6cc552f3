"""SCAFFOLD (Karimireddy et al., 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", Algorithm 1, control-variate option II), under user-level DP.

Each user i keeps a control variate c_i (its state across rounds, from 0; fl.user_state) and the
server keeps c (from 0). A client corrects every local gradient by the drift between them,

    ∇ ← ∇L_i(y) + c − c_i                                 (before the local clip, like FedProx)

and after its K local steps of lr η_l, with Δ = x − y,

    c_i⁺ = c_i − c + Δ / (K η_l),  projected onto ‖c_i⁺‖ ≤ C_loc,

and sends Δ and Δc_i = c_i⁺ − c_i. The server steps x with the averaged Δ like every algorithm
(its optimizer, its lr) and sets c ← c + (1/N) Σ_i Δc_i. The projection is pflbench's: the
paper's c_i⁺ averages local gradients and needs no bound, but nothing else bounds it once the
gradients are clipped and corrected; with it ‖Δc_i‖ ≤ 2 C_loc, which fixes the exact sum's range.

User-level DP: everything a user sends is one payload, privatized together. Δc_i is sent in Δ's
units, s·Δc_i with s = η_l·K_nominal (the local steps of the recipe, 1 with local epochs), so
that one bound fits both halves, and the payload (Δ, s·Δc_i) is what clipping bounds: global
clipping ‖(Δ, s·Δc_i)‖ ≤ C; per-layer clipping counts each control tensor as one more layer, so
"dim" gives the Δ half and the Δc half C/√2 each (their dimensions are equal) and "uniform"
C/√(2H) per tensor. The server's Gaussian noise of std C·σ_DP covers every coordinate of the
averaged payload, so the sensitivity is C as for FedAvg and the accountant's ε is unchanged; c is
post-processing of released averages, and c_i never leaves the user except through the payload.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pflbench.fl.algorithms.base import CLIENT_ALGORITHMS, AlgorithmContext, ClientAlgorithm
from pflbench.fl.local_update import LocalUpdate
from pflbench.spec.models import ClientRecipe

PREFIX = "scaffold.control."  # payload entries: the control-variate update per trained tensor


@CLIENT_ALGORITHMS.register("scaffold")
class Scaffold(ClientAlgorithm):
    def __init__(self, recipe: ClientRecipe, context: AlgorithmContext):
        super().__init__(recipe, context)
        self.server_control = [torch.zeros_like(p) for p in context.params]  # c
        self.scale = recipe.lr * (recipe.local_steps or 1)  # s: Δc in Δ's units
        self.users: Sequence[str] = ()

    def start_group(self, local: LocalUpdate, users: Sequence[str], step: int) -> None:
        if not hasattr(self, "controls"):
            self.controls = [torch.empty_like(p) for p in local.params]  # c_i per slot
            self.correction = [torch.empty_like(p) for p in local.params]  # c − c_i
            self.sent = [torch.empty_like(p) for p in local.params]  # s·Δc_i
        self.users = users
        with torch.no_grad():
            for g in range(local.group_size):
                state = self.context.user_states.load(users[g], step) if g < len(users) else None
                for name, control in zip(self.context.names, self.controls, strict=True):
                    control[g] = 0.0 if state is None else state[name]
            torch._foreach_copy_(self.correction, [c.expand_as(x) for c, x in zip(
                self.server_control, self.controls, strict=True)])  # fmt: skip
            torch._foreach_sub_(self.correction, self.controls)

    @torch.no_grad()
    def correct(self, local: LocalUpdate) -> None:
        torch._foreach_add_(local.grads, self.correction)

    def payload_like(self) -> dict[str, torch.Tensor]:
        return {PREFIX + n: p for n, p in zip(self.context.names, self.context.params, strict=True)}

    def payload_bound(self, update_bound: float) -> float:
        # ‖s·Δc_i‖ ≤ s·2·C_loc ≤ 2·(the bound of Δ).
        return max(update_bound, 2 * self.scale * self.recipe.grad_clip)

    @torch.no_grad()
    def payload(
        self, local: LocalUpdate, users: Sequence[str], local_steps: list[int], step: int
    ) -> list[dict[str, torch.Tensor]]:
        names = self.context.names
        out = []
        for g, user in enumerate(users):
            old = [c[g] for c in self.controls]
            sent = [s[g] for s in self.sent]
            if local_steps[g] == 0:  # no data this round: nothing learned, nothing changes
                torch._foreach_zero_(sent)
            else:
                # c_i⁺ = c_i − c + Δ/(K η_l), projected onto the local clip bound, built in the
                # slot's send buffer (no allocation per client), saved, then turned into s·Δc_i.
                torch._foreach_copy_(sent, old)
                torch._foreach_sub_(sent, self.server_control)
                rate = 1 / (local_steps[g] * self.recipe.lr)
                torch._foreach_add_(sent, local.delta_slots[g], alpha=rate)
                norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(sent)))
                shrink = torch.clamp(self.recipe.grad_clip / (norm + 1e-12), max=1.0)
                torch._foreach_mul_(sent, shrink)
                self.context.user_states.save(user, step, dict(zip(names, sent, strict=True)))
                torch._foreach_sub_(sent, old)
                torch._foreach_mul_(sent, self.scale)
            out.append({PREFIX + n: s for n, s in zip(names, sent, strict=True)})
        return out

    @torch.no_grad()
    def server_step(self, averaged: dict[str, torch.Tensor]) -> None:
        # The average is Σ s·Δc_i / (qN): c += (1/N) Σ Δc_i = q · average / s.
        update = [averaged[PREFIX + n] for n in self.context.names]
        torch._foreach_add_(
            self.server_control, update, alpha=self.context.sampling_rate / self.scale
        )

    def privacy_note(self) -> str:
        return (
            "SCAFFOLD: each user's payload is its update and its control-variate update in the"
            f" update's units (x{self.scale:g}), clipped together to C and noised together: the"
            " sensitivity stays C"
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            f"control.{n}": c for n, c in zip(self.context.names, self.server_control, strict=True)
        }

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, control in zip(self.context.names, self.server_control, strict=True):
            control.copy_(tensors[f"control.{name}"])
