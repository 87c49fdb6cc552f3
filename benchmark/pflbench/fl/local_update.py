"""The client's local update rule, written once for G clients stacked [G, ...] (G = 1: one client).

Local step k of client g, from θ_g = θ_global at k = 0 (paper Algorithm 1, client side):

    ∇_g  = ∇L_g(θ_g) + (the client algorithm's corrections, fl.algorithms)
    ∇_g  = 0                                           if client g has no batch at step k
    ∇_g ← ∇_g · min(1, C_loc / (‖∇_g‖ + 1e-6))         as torch.nn.utils.clip_grad_norm_
    θ_g ← θ_g − lr ∇_g                                 SGD

and the client's update is Δ_g = θ_global − θ_g. The trainers (fl.client, fl.parallel) run the
forward and backward and the algorithm's hooks; `LocalUpdate` holds the group's tensors and does
the rest, in place. For G = 1 every operation is the one `clip_grad_norm_(foreach=True)` and a
foreach SGD step perform on the unstacked tensors, so one client at a time gives bitwise the same
update. Given a `compiler` (torch.compile with the trainer's settings), the clipping and the SGD
step run as one compiled graph: torch operations only, no host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pflbench.spec.models import ClientRecipe


class LocalUpdate:
    """The rule above on `params`, a list of [G, ...] tensors that the trainer owns (what its
    forward reads), and each local step's gradients, [G, ...] tensors handed over by
    `take_grads` (the trainer's backward makes new ones each step: nothing to zero or accumulate
    into). Algorithms read `global_params` (broadcast [G, ...] views of the global weights), may
    correct `grads` in place, and may use `delta` (per client: `delta_slots`) as scratch during
    the local steps. With `delta_buffers=R` groups take R Δ buffers in turn: a group's Δ stays
    valid through the next R - 1 groups (what lets the exact sum take several clients' in one
    pass, fl.aggregate)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        recipe: ClientRecipe,
        compiler: Callable[[Callable], Callable] | None = None,
        delta_buffers: int = 1,
    ):
        self.params, self.recipe = params, recipe
        self.group_size = params[0].shape[0]
        # Δ at the end, in one [G, total] buffer with a view per tensor: each client's Δ is one
        # contiguous span, which the exact sum scales without gathering it first.
        sizes = [p[0].numel() for p in params]
        self._delta_buffers = []
        for _ in range(delta_buffers):
            flat = params[0].new_empty(self.group_size, sum(sizes))
            pieces = flat.split(sizes, dim=1)
            views = [piece.view(p.shape) for piece, p in zip(pieces, params, strict=True)]
            slots = [[d[i] for d in views] for i in range(self.group_size)]
            self._delta_buffers.append((views, slots))
        self._turn = 0
        self.delta, self.delta_slots = self._delta_buffers[0]
        self.grads: list[torch.Tensor] = []
        self.grad_slots: list[list[torch.Tensor]] = []
        self.global_params: list[torch.Tensor] = []
        self._clip_and_descend = (
            compiler(self.clip_and_descend) if compiler else self.clip_and_descend
        )

    def take_grads(self, grads: list[torch.Tensor]) -> None:
        """This local step's gradients ([G, ...], like `params`), which the rule changes in
        place: one a backward formula returned as a broadcast view is copied first. They are
        valid for this local step only: under CUDA graphs (`--compile` on CUDA) the next step's
        backward writes into the same memory, so an algorithm keeps what it needs by copying."""
        self.grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        # Each client's slices, for the per-client norms, clipping and noise draws (one client:
        # the tensors themselves).
        if self.group_size == 1:
            self.grad_slots = [self.grads]
        else:
            self.grad_slots = [[g[i] for g in self.grads] for i in range(self.group_size)]

    @torch.no_grad()
    def start(self, global_params: list[torch.Tensor]) -> None:
        """Every client starts from the global weights (given unstacked; broadcast, not copied),
        its Δ in the next buffer."""
        self._turn = (self._turn + 1) % len(self._delta_buffers)
        self.delta, self.delta_slots = self._delta_buffers[self._turn]
        self.global_params = [
            g.expand_as(p) for g, p in zip(global_params, self.params, strict=True)
        ]
        torch._foreach_copy_(self.params, self.global_params)

    @torch.no_grad()
    def step(self, idle: list[int]) -> None:
        """One local step from the gradients taken. Clients in `idle` (schedule ended, or
        an empty slot) get a zero gradient: not even a NaN of a padding slot can move them."""
        if idle:
            torch._foreach_zero_([g for i in idle for g in self.grad_slots[i]])
        self._clip_and_descend()

    @torch.no_grad()
    def clip_and_descend(self) -> None:
        """Each client's gradient clipped to C_loc, then the SGD step (every client)."""
        norms = torch._foreach_norm([g for slot in self.grad_slots for g in slot])
        total = torch.linalg.vector_norm(torch.stack(norms).view(self.group_size, -1), dim=1)
        coef = torch.clamp(self.recipe.grad_clip / (total + 1e-6), max=1.0)
        for i, slot in enumerate(self.grad_slots):
            torch._foreach_mul_(slot, coef[i])
        torch._foreach_add_(self.params, self.grads, alpha=-self.recipe.lr)

    @torch.no_grad()
    def finish(self) -> list[torch.Tensor]:
        """Δ = θ_global − θ per client, in the delta buffer (valid until the next `start`). One
        pass per tensor: a foreach copy and a foreach subtraction take two passes over the model
        (the same values; on the 2-core CPU 4.9 against 7.0 ms per client of synth-cpu-m)."""
        for delta, start, trained in zip(self.delta, self.global_params, self.params, strict=True):
            torch.sub(start, trained, out=delta)
        return self.delta
