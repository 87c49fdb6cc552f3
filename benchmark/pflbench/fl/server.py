"""The server's step: the registered optimizer rule (pflbench.fl.server_optimizers) applied to the
pseudo-gradient g (the averaged, clipped, noised client delta) at the step's learning rate.

ServerOptimizer updates a list of parameter tensors in place with foreach ops and keeps the rule's
state in named tensors so a checkpoint can restore it exactly.
"""

from __future__ import annotations

import torch

from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS
from pflbench.spec.models import LrDecay, ServerRecipe


def exponential_decay_lr(step: int, base_lr: float, decay: LrDecay) -> float:
    """The server's lr at central step t: constant, then lr·rate^((t − start)/transition) for
    t ≥ start (optax.exponential_decay with transition_begin, not staircased). Seed training has
    its own schedule (warmup, then a staircase: pflbench.central.step_decay_lr)."""
    if step < decay.start:
        return base_lr
    return base_lr * decay.rate ** ((step - decay.start) / decay.transition)


class ServerOptimizer:
    """One optimizer for a fixed list of named tensors; `step(grads, lr)` updates them in place."""

    def __init__(self, recipe: ServerRecipe, names: list[str], params: list[torch.Tensor]):
        self.recipe = recipe
        self.rule = SERVER_OPTIMIZERS[recipe.optimizer]
        self.names = names
        self.params = params
        self.count = 0
        self.state: dict[str, list[torch.Tensor]] = {
            slot: [torch.full_like(p, initial) for p in params]
            for slot, initial in self.rule.slots(recipe).items()
        }

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        self.count += 1
        torch._foreach_add_(self.params, self.rule.update(self, grads, lr))

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {"count": torch.tensor(self.count, dtype=torch.int64)}
        for slot, values in self.state.items():
            tensors.update({f"{slot}.{n}": t for n, t in zip(self.names, values, strict=True)})
        return tensors

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.count = int(tensors["count"])
        for slot, values in self.state.items():
            for name, target in zip(self.names, values, strict=True):
                target.copy_(tensors[f"{slot}.{name}"])
