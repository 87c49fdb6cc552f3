"""The client's local update rule, written once for G clients stacked [G, ...] (G = 1: one client).

Local step k of client g, from θ_g = θ_global at k = 0 (paper Algorithm 1, client side):

    θ̃_g  = θ_g + N(0, σ_vn²)                          variational weight noise (if σ_vn > 0)
    ∇_g  = ∇L_g(θ̃_g) + μ (θ_g − θ_global)             the gradient at the noisy weights; FedProx
    ∇_g  = 0                                           if client g has no batch at step k
    ∇_g ← ∇_g · min(1, C_loc / (‖∇_g‖ + 1e-6))         as torch.nn.utils.clip_grad_norm_
    θ_g ← θ_g − lr ∇_g                                 SGD, applied to the clean weights

and the client's update is Δ_g = θ_global − θ_g. The trainers (fl.client, fl.parallel) run the
forward and backward; `LocalUpdate` does everything else, in place on the trainer's tensors. For
G = 1 every operation is the one `clip_grad_norm_(foreach=True)` and a foreach SGD step perform on
the unstacked tensors, so one client at a time gives bitwise the same update.
"""

from __future__ import annotations

import torch

from pflbench.spec.models import ClientRecipe


class LocalUpdate:
    """The rule above on `params` and their `grads`, each a list of [G, ...] tensors that the
    trainer owns (its backward accumulates into `grads`; `params` are what its forward reads)."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], recipe: ClientRecipe):
        self.params, self.grads, self.recipe = params, grads, recipe
        self.group_size = params[0].shape[0]
        # Δ at the end; scratch (FedProx distance, weight noise) during the local steps.
        self.delta = [torch.empty_like(p) for p in params]
        needs_noise = recipe.variational_noise.std > 0
        self.clean_weights = [torch.empty_like(p) for p in params] if needs_noise else []
        # Each client's slices, for the per-client norms, clipping and noise draws.
        self._grad_slots = [[g[i] for g in grads] for i in range(self.group_size)]
        self._delta_slots = [[d[i] for d in self.delta] for i in range(self.group_size)]
        self._global: list[torch.Tensor] = []

    @torch.no_grad()
    def start(self, global_params: list[torch.Tensor]) -> None:
        """Every client starts from the global weights (given unstacked; broadcast, not copied)."""
        self._global = [g.expand_as(p) for g, p in zip(global_params, self.params, strict=True)]
        torch._foreach_copy_(self.params, self._global)

    @torch.no_grad()
    def zero_grad(self) -> None:
        torch._foreach_zero_(self.grads)

    @torch.no_grad()
    def add_weight_noise(
        self, std: float, active: list[int], generators: list[torch.Generator]
    ) -> None:
        """Keep the clean weights, then add N(0, std²) from each active client's own generator
        (drawn into the free delta buffer; other slots get none)."""
        torch._foreach_copy_(self.clean_weights, self.params)
        drawing = set(active)
        for i, slot in enumerate(self._delta_slots):
            if i not in drawing:
                torch._foreach_zero_(slot)
                continue
            for noise in slot:
                noise.normal_(0.0, std, generator=generators[i])
        torch._foreach_add_(self.params, self.delta)

    @torch.no_grad()
    def restore_clean_weights(self) -> None:
        torch._foreach_copy_(self.params, self.clean_weights)

    @torch.no_grad()
    def step(self, idle: list[int]) -> None:
        """One local step from the gradients in `grads`. Clients in `idle` (schedule ended, or
        an empty slot) get a zero gradient: not even a NaN of a padding slot can move them."""
        if self.recipe.fedprox_mu:
            # ∇ (mu/2)‖θ − θ_g‖² = mu (θ − θ_g); the delta buffer is free scratch until the end.
            torch._foreach_copy_(self.delta, self.params)
            torch._foreach_sub_(self.delta, self._global)
            torch._foreach_add_(self.grads, self.delta, alpha=self.recipe.fedprox_mu)
        if idle:
            torch._foreach_zero_([g for i in idle for g in self._grad_slots[i]])
        norms = torch._foreach_norm([g for slot in self._grad_slots for g in slot])
        total = torch.linalg.vector_norm(torch.stack(norms).view(self.group_size, -1), dim=1)
        coef = torch.clamp(self.recipe.grad_clip / (total + 1e-6), max=1.0)
        for i, slot in enumerate(self._grad_slots):
            torch._foreach_mul_(slot, coef[i])
        torch._foreach_add_(self.params, self.grads, alpha=-self.recipe.lr)

    @torch.no_grad()
    def finish(self) -> list[torch.Tensor]:
        """Δ = θ_global − θ per client, in the delta buffer (valid until the next `start`)."""
        torch._foreach_copy_(self.delta, self._global)
        torch._foreach_sub_(self.delta, self.params)
        return self.delta
