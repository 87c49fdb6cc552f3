"""Optimizers of central (seed-model) training: LARS and the per-recipe choice, and the trust ratio
that LARS and the server's LAMB/LARS (pflbench.fl.server_optimizers) share."""

from __future__ import annotations

import torch
from torch import Tensor

from pflbench.spec.models import CentralRecipe


def trust_ratio(
    param_norm: Tensor, update_norm: Tensor, coefficient: float = 1.0, eps: float = 0.0
) -> Tensor:
    """coefficient·‖θ‖/(‖u‖ + eps) from (tensors of) norms, exactly 1 where either norm is zero
    (optax.scale_by_trust_ratio, whose eps is 0). The denominator is held >= 1e-38 so that the
    branch not taken never divides by zero."""
    usable = (param_norm > 0) & (update_norm > 0)
    ratio = coefficient * param_norm / (update_norm + eps).clamp_min(1e-38)
    return ratio.where(usable, 1.0)


class LARS(torch.optim.Optimizer):
    """LARS (You et al., 2017) with momentum. For parameters in groups with `adapt=True` the step
    is scaled per tensor by the trust ratio η·‖w‖/(‖g + λw‖ + eps) (1 where either norm is 0; the
    server's LARS computes it with the same `trust_ratio`; norms accumulated in fp64); groups with
    `adapt=False` (norms and biases) take plain momentum SGD steps without weight decay or trust
    ratio. Unlike the server's (optax.lars), lr multiplies the momentum buffer, not the step that
    enters it."""

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-9,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            adapt=True,
            trust_coefficient=trust_coefficient,
            eps=eps,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if group["adapt"]:
                    update = update + group["weight_decay"] * p
                    trust = trust_ratio(
                        p.norm(dtype=torch.float64),
                        update.norm(dtype=torch.float64),
                        group["trust_coefficient"],
                        group["eps"],
                    )
                    update = update * trust
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = update.clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(update)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])


def make_central_optimizer(named_params, recipe: CentralRecipe) -> torch.optim.Optimizer:
    """Weight matrices and conv kernels get weight decay (and LARS's trust ratio); norms and
    biases (the 1-D tensors) do not."""
    params = [p for _, p in named_params if p.requires_grad]
    adapted = [p for p in params if p.ndim > 1]
    plain = [p for p in params if p.ndim <= 1]
    groups = [
        {"params": adapted, "weight_decay": recipe.weight_decay},
        {"params": plain, "weight_decay": 0.0, "adapt": False},
    ]
    if recipe.optimizer == "lars":
        return LARS(groups, lr=recipe.lr)
    for g in groups:
        g.pop("adapt", None)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(groups, lr=recipe.lr)
    if recipe.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=recipe.lr)
    return torch.optim.SGD(groups, lr=recipe.lr, momentum=0.9)
