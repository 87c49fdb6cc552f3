"""Server optimizers applied to the pseudo-gradient g (the averaged, clipped, noised client delta).

Each optimizer updates a list of parameter tensors in place with foreach ops and keeps its state
in named tensors so a checkpoint can restore it exactly. The update rules follow optax (the
paper's library, App. G.4) with its defaults where the recipe has no key, except AdaGrad, which
follows the paper authors' code unless `adagrad_rule: optax`:
- LAMB (paper App. E.4): Adam moments with bias correction, u = m̂/(√v̂ + ξ) + λθ,
  θ ← θ − lr·(‖θ‖/‖u‖)·u per tensor (trust ratio 1 where either norm is 0).
- Adam: θ ← θ − lr·(m̂/(√v̂ + ξ) + λθ).
- LARS: u = g + λθ scaled by 0.001·‖θ‖/‖u‖ (by 1 where either norm is 0), then lr, then
  momentum (optax.lars).
- AdaGrad, reference rule: acc starts at 0, acc ← acc + g², θ ← θ − lr·g·(1/√acc + ξ), with
  1/√acc taken as 0 where acc = 0 (a coordinate whose gradients were all 0 does not move).
- AdaGrad, optax rule: acc starts at 0.1, acc ← acc + g², θ ← θ − lr·g/√(acc + ξ).
- SGD: optional momentum μ and weight decay λ: m ← μm + g + λθ, θ ← θ − lr·m.
"""

from __future__ import annotations

import torch

from pflbench.spec.models import LrDecay, ServerRecipe

OPTAX_ADAGRAD_INITIAL_ACCUMULATOR = 0.1  # optax.adagrad default
LARS_TRUST_COEFFICIENT = 0.001  # optax.lars default (the paper's LARS lrs, Table 9, assume it)


def learning_rate(step: int, base_lr: float, decay: LrDecay) -> float:
    """Constant, then lr·rate^((t − start)/transition) for t ≥ start (optax.exponential_decay)."""
    if step < decay.start:
        return base_lr
    return base_lr * decay.rate ** ((step - decay.start) / decay.transition)


def trust_ratios(
    params: list[torch.Tensor], updates: list[torch.Tensor], coefficient: float = 1.0
) -> torch.Tensor:
    """coefficient·‖θ_h‖/‖u_h‖ per tensor, exactly 1 where either norm is zero
    (optax.scale_by_trust_ratio)."""
    param_norms = torch.stack(torch._foreach_norm(params))
    update_norms = torch.stack(torch._foreach_norm(updates))
    usable = (param_norms > 0) & (update_norms > 0)
    return torch.where(usable, coefficient * param_norms / update_norms.clamp_min(1e-38), 1.0)


class ServerOptimizer:
    """One optimizer for a fixed list of named tensors; `step(grads, lr)` updates them in place."""

    def __init__(self, recipe: ServerRecipe, names: list[str], params: list[torch.Tensor]):
        self.recipe = recipe
        self.names = names
        self.params = params
        self.count = 0
        self.state: dict[str, list[torch.Tensor]] = {}
        kind = recipe.optimizer
        if kind in ("lamb", "adam"):
            self.state["m"] = [torch.zeros_like(p) for p in params]
            self.state["v"] = [torch.zeros_like(p) for p in params]
        elif kind == "adagrad":
            initial = OPTAX_ADAGRAD_INITIAL_ACCUMULATOR if recipe.adagrad_rule == "optax" else 0.0
            self.state["acc"] = [torch.full_like(p, initial) for p in params]
        elif kind in ("lars", "sgd") and recipe.momentum > 0:
            self.state["momentum"] = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        self.count += 1
        update = getattr(self, f"_{self.recipe.optimizer}")(grads, lr)
        torch._foreach_add_(self.params, update)

    # Each rule returns the additive update (already multiplied by −lr).

    def _adam_direction(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        r, t = self.recipe, self.count
        m, v = self.state["m"], self.state["v"]
        torch._foreach_lerp_(m, grads, 1 - r.beta1)
        torch._foreach_mul_(v, r.beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - r.beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, (1 - r.beta2**t) ** 0.5)
        torch._foreach_add_(denom, r.eps)
        direction = torch._foreach_div(m, denom)
        torch._foreach_div_(direction, 1 - r.beta1**t)
        if r.weight_decay:
            torch._foreach_add_(direction, self.params, alpha=r.weight_decay)
        return direction

    def _lamb(self, grads: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
        direction = self._adam_direction(grads)
        ratios = trust_ratios(self.params, direction)
        torch._foreach_mul_(direction, (-lr * ratios).tolist())
        return direction

    def _adam(self, grads: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
        direction = self._adam_direction(grads)
        torch._foreach_mul_(direction, -lr)
        return direction

    def _lars(self, grads: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
        direction = torch._foreach_add(grads, self.params, alpha=self.recipe.weight_decay)
        ratios = trust_ratios(self.params, direction, LARS_TRUST_COEFFICIENT)
        torch._foreach_mul_(direction, (-lr * ratios).tolist())
        if "momentum" not in self.state:
            return direction
        momentum = self.state["momentum"]
        torch._foreach_mul_(momentum, self.recipe.momentum)
        torch._foreach_add_(momentum, direction)
        return momentum

    def _adagrad(self, grads: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
        acc = self.state["acc"]
        torch._foreach_addcmul_(acc, grads, grads)
        if self.recipe.adagrad_rule == "optax":
            denom = torch._foreach_add(acc, self.recipe.eps)
            torch._foreach_sqrt_(denom)
            direction = torch._foreach_div(grads, denom)
        else:
            # 1/√acc is 0 where acc = 0 (then g = 0 too, up to g² underflowing): 0/0 → 0, not NaN.
            scale = [torch.where(a > 0, a.rsqrt(), 0.0) for a in acc]
            torch._foreach_add_(scale, self.recipe.eps)
            direction = torch._foreach_mul(grads, scale)
        torch._foreach_mul_(direction, -lr)
        return direction

    def _sgd(self, grads: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
        direction = torch._foreach_add(grads, self.params, alpha=self.recipe.weight_decay)
        if "momentum" in self.state:
            momentum = self.state["momentum"]
            torch._foreach_mul_(momentum, self.recipe.momentum)
            torch._foreach_add_(momentum, direction)
            direction = [m.clone() for m in momentum]
        torch._foreach_mul_(direction, -lr)
        return direction

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
