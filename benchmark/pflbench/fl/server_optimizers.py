"""The registry of server optimizers, the rules that turn the pseudo-gradient g (the averaged,
clipped, noised client delta) into the server's step.

Each optimizer is a `ServerRule`: the state tensors it keeps beside every parameter (named slots,
saved in checkpoints as `server.<slot>.<parameter>`) and its update, written with foreach ops.
The rules follow optax's update formulas (the paper's library, App. G.4), except AdaGrad, which
follows the paper authors' code unless `adagrad_rule: optax`. Their hyperparameters are the
recipe's (ServerRecipe), not optax's per-optimizer defaults: ξ = 1e-6 for every rule (paper App.
H.3), no momentum and no weight decay unless set, where optax has ξ 1e-8 (Adam), 1e-7 (AdaGrad)
and 0 (LARS) and LARS momentum 0.9; a spec that wants those sets them (the server-* baselines
set theirs):
- LAMB (paper App. E.4): Adam moments with bias correction, u = m̂/(√v̂ + ξ) + λθ,
  θ ← θ − lr·(‖θ‖/‖u‖)·u per tensor (trust ratio 1 where either norm is 0).
- Adam: θ ← θ − lr·(m̂/(√v̂ + ξ) + λθ).
- LARS: u = g + λθ scaled by 0.001·‖θ‖/(‖u‖ + ξ) (by 1 where either norm is 0), then lr, then
  momentum (optax.lars, with the paper authors' ξ = 1e-6 where optax has 0).
- AdaGrad, reference rule: acc starts at 0, acc ← acc + g², θ ← θ − lr·g·(1/√acc + ξ), with
  1/√acc taken as 0 where acc = 0 (a coordinate whose gradients were all 0 does not move).
- AdaGrad, optax rule: acc starts at 0.1, acc ← acc + g², θ ← θ − lr·g/√(acc + ξ).
- SGD: optional momentum μ and weight decay λ: m ← μm + g + λθ, θ ← θ − lr·m.

Specs name a rule (ServerRecipe.optimizer); pflbench.methods checks the name against
SERVER_OPTIMIZERS and pflbench.fl.server.ServerOptimizer runs it. Adding one is a slots function,
an update function, a `ServerRule` registered in SERVER_OPTIMIZERS (here, or from a plug-in:
pflbench.plugins) and a test of a step computed by hand.

The rules import torch when they run, not when this module is imported: checking specs' names
(`pflbench tasks`, ...) does not load torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pflbench.extension import ExtensionPoint

if TYPE_CHECKING:
    from torch import Tensor

    from pflbench.fl.server import ServerOptimizer
    from pflbench.spec.models import ServerRecipe

OPTAX_ADAGRAD_INITIAL_ACCUMULATOR = 0.1  # optax.adagrad default
LARS_TRUST_COEFFICIENT = 0.001  # optax.lars default (the paper's LARS lrs, Table 9, assume it)


@dataclass(frozen=True)
class ServerRule:
    name: str  # the value of federated.server.optimizer
    # The state slots for a recipe: slot name -> the value its tensors start at (state_dict order).
    slots: Callable[[ServerRecipe], dict[str, float]]
    # The additive update of one step (already multiplied by −lr), given the optimizer (its
    # recipe, step count, params and state, which the rule updates in place), g and lr.
    update: Callable[[ServerOptimizer, list[Tensor], float], list[Tensor]]


# ----------------------------------------------------------------------------------------------
# Trust ratios (LAMB, LARS; the function is shared with the seed model's LARS, pflbench.model.optim)


def trust_ratios(
    params: list[Tensor], updates: list[Tensor], coefficient: float = 1.0, eps: float = 0.0
) -> Tensor:
    """The trust ratio of every tensor, coefficient·‖θ_h‖/(‖u_h‖ + eps) (1 where either norm is
    0), fp64. The norms are accumulated in fp64: fp32 accumulation is ~1e-4 relative off for the
    paper model's large tensors (optax's fp32 norms: ~1e-5)."""
    from pflbench.model.optim import trust_ratio
    from pflbench.privacy.clipping import layer_norms

    return trust_ratio(layer_norms(params), layer_norms(updates), coefficient, eps)


# ----------------------------------------------------------------------------------------------
# The rules


def adam_slots(recipe: ServerRecipe) -> dict[str, float]:
    return {"m": 0.0, "v": 0.0}


def adam_direction(opt: ServerOptimizer, grads: list[Tensor]) -> list[Tensor]:
    """m̂/(√v̂ + ξ) + λθ, updating the moments m and v (LAMB and Adam)."""
    import torch

    r, t = opt.recipe, opt.count
    m, v = opt.state["m"], opt.state["v"]
    torch._foreach_lerp_(m, grads, 1 - r.beta1)
    torch._foreach_mul_(v, r.beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - r.beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, (1 - r.beta2**t) ** 0.5)
    torch._foreach_add_(denom, r.eps)
    direction = torch._foreach_div(m, denom)
    torch._foreach_div_(direction, 1 - r.beta1**t)
    if r.weight_decay:
        torch._foreach_add_(direction, opt.params, alpha=r.weight_decay)
    return direction


def lamb_update(opt: ServerOptimizer, grads: list[Tensor], lr: float) -> list[Tensor]:
    import torch

    direction = adam_direction(opt, grads)
    ratios = trust_ratios(opt.params, direction)
    torch._foreach_mul_(direction, (-lr * ratios).tolist())
    return direction


def adam_update(opt: ServerOptimizer, grads: list[Tensor], lr: float) -> list[Tensor]:
    import torch

    direction = adam_direction(opt, grads)
    torch._foreach_mul_(direction, -lr)
    return direction


def momentum_slots(recipe: ServerRecipe) -> dict[str, float]:
    """LARS and SGD keep a momentum buffer only when momentum is on."""
    return {"momentum": 0.0} if recipe.momentum > 0 else {}


def lars_update(opt: ServerOptimizer, grads: list[Tensor], lr: float) -> list[Tensor]:
    import torch

    direction = torch._foreach_add(grads, opt.params, alpha=opt.recipe.weight_decay)
    ratios = trust_ratios(opt.params, direction, LARS_TRUST_COEFFICIENT, opt.recipe.eps)
    torch._foreach_mul_(direction, (-lr * ratios).tolist())
    if "momentum" not in opt.state:
        return direction
    momentum = opt.state["momentum"]
    torch._foreach_mul_(momentum, opt.recipe.momentum)
    torch._foreach_add_(momentum, direction)
    return momentum


def adagrad_slots(recipe: ServerRecipe) -> dict[str, float]:
    optax = recipe.adagrad_rule == "optax"
    return {"acc": OPTAX_ADAGRAD_INITIAL_ACCUMULATOR if optax else 0.0}


def adagrad_update(opt: ServerOptimizer, grads: list[Tensor], lr: float) -> list[Tensor]:
    import torch

    acc = opt.state["acc"]
    torch._foreach_addcmul_(acc, grads, grads)
    if opt.recipe.adagrad_rule == "optax":
        denom = torch._foreach_add(acc, opt.recipe.eps)
        torch._foreach_sqrt_(denom)
        direction = torch._foreach_div(grads, denom)
    else:
        # 1/√acc is 0 where acc = 0 (then g = 0 too, up to g² underflowing): 0/0 → 0, not NaN.
        scale = [torch.where(a > 0, a.rsqrt(), 0.0) for a in acc]
        torch._foreach_add_(scale, opt.recipe.eps)
        direction = torch._foreach_mul(grads, scale)
    torch._foreach_mul_(direction, -lr)
    return direction


def sgd_update(opt: ServerOptimizer, grads: list[Tensor], lr: float) -> list[Tensor]:
    import torch

    direction = torch._foreach_add(grads, opt.params, alpha=opt.recipe.weight_decay)
    if "momentum" in opt.state:
        momentum = opt.state["momentum"]
        torch._foreach_mul_(momentum, opt.recipe.momentum)
        torch._foreach_add_(momentum, direction)
        direction = [m.clone() for m in momentum]
    torch._foreach_mul_(direction, -lr)
    return direction


# ----------------------------------------------------------------------------------------------
# The registry (plug-ins add rules: pflbench.plugins)

SERVER_OPTIMIZERS = ExtensionPoint(
    "server optimizer",
    (
        (rule.name, rule)
        for rule in (
            ServerRule("lamb", adam_slots, lamb_update),
            ServerRule("adam", adam_slots, adam_update),
            ServerRule("lars", momentum_slots, lars_update),
            ServerRule("adagrad", adagrad_slots, adagrad_update),
            ServerRule("sgd", momentum_slots, sgd_update),
        )
    ),
    entry_type=ServerRule,
)
