"""A pflbench plug-in: the Yogi server optimizer (Zaheer et al., 2018), as FedYogi in Reddi et al.,
"Adaptive Federated Optimization" (ICLR 2021). One file, no edits to pflbench:

    pflbench run --plugin docs/examples/server_yogi.py --specs docs/examples/specs \
        --task synth-cv-en-ls-seed --baseline server-yogi --budget none

Yogi is Adam with an additive second-moment update that cannot grow v faster than g² does:
    m ← β1·m + (1 − β1)·g
    v ← v − (1 − β2)·sign(v − g²)·g²
    θ ← θ − lr·m/(√v + ξ)
(no bias correction, v starts at ξ² as in the paper's FedYogi; the recipe's beta1, beta2 and eps
are used, so a baseline sets them like any server optimizer's).
"""

import torch

from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS, ServerRule

__version__ = "1.0"


def yogi_slots(recipe) -> dict[str, float]:
    return {"m": 0.0, "v": recipe.eps**2}


def yogi_update(opt, grads: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
    r = opt.recipe
    m, v = opt.state["m"], opt.state["v"]
    torch._foreach_lerp_(m, grads, 1 - r.beta1)
    for v_h, g_h in zip(v, grads, strict=True):
        g2 = g_h * g_h
        v_h.addcmul_(torch.sign(v_h - g2), g2, value=-(1 - r.beta2))
    denom = torch._foreach_sqrt(v)
    torch._foreach_add_(denom, r.eps)
    step = torch._foreach_div(m, denom)
    torch._foreach_mul_(step, -lr)
    return step


SERVER_OPTIMIZERS.register("yogi", ServerRule("yogi", yogi_slots, yogi_update))
