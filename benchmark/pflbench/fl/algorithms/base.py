"""The client-algorithm interface and its registry (after pfl-research's FederatedAlgorithm): what a
client does around local SGD, what it sends beside Δ, and what the server does with that.

The trainers (fl.client: one client at a time, or G clients stacked under vmap, fl.parallel) run
the local update rule of fl.local_update and call an algorithm's hooks on the group's tensors
stacked [G, ...] (G = 1: one client), so one definition serves both:

    select_utterances(utterances, generator)   the data a client trains on this round
    start_group(local, users, step)            before the first local step (load user state)
    perturb(local, active) / unperturb(local)  around each forward/backward
    correct(local)                             on each local gradient, before local clipping
    payload(local, users, local_steps, step)   after the last step: tensors sent beside Δ
    server_step(averaged)                      the averaged, privatized payload tensors

Everything in the payload goes through the same per-user privacy steps as Δ (zeroed if
non-finite, clipped, noised) and the same exact sum, so what an algorithm sends is covered by the
DP bound; what its code keeps of a client's data is its own (docs/PLUGINS.md): user states are
sealed while server_step runs. State that must survive a kill goes into `state_dict` (the
server's) or `AlgorithmContext.user_states` (each user's, fl.user_state); both are restored
exactly on resume.

An algorithm reads the common ClientRecipe fields (lr, local steps or epochs, batch, grad_clip)
and the fields it names in `uses`; `check` refuses a recipe that sets a field the chosen
algorithm would ignore. Plug-in algorithms take their options from `algorithm_options`,
validated by their `Options` model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ValidationError

from pflbench.data.store import Utterance
from pflbench.errors import UserError
from pflbench.extension import ExtensionPoint
from pflbench.fl.local_update import LocalUpdate
from pflbench.fl.user_state import UserStateStore
from pflbench.seeds import keyed_generator
from pflbench.spec.models import ClientRecipe, FederatedVariationalNoise, NoOptions
from pflbench.spec.registry import format_validation_error

# ClientRecipe fields an algorithm may own (`uses`); the others are every algorithm's.
ALGORITHM_FIELDS = ("fedprox_mu", "max_utterances", "variational_noise")


@dataclass
class AlgorithmContext:
    """What a run gives its algorithm: the trained tensors (global values; names, shapes,
    device), the run seed, each user's persistent state, and q = (expected cohort) / population,
    the fraction of users the averaged payload stands for."""

    names: list[str]
    params: list[torch.Tensor]
    seed: int
    device: str
    user_states: UserStateStore
    sampling_rate: float


class ClientAlgorithm:
    """FedAvg: local SGD from the global model, Δ = θ_global − θ_local sent, nothing else. Every
    hook is a no-op; an algorithm overrides the ones it needs."""

    uses: ClassVar[tuple[str, ...]] = ()  # ClientRecipe fields beyond the common ones
    Options: ClassVar[type[BaseModel]] = NoOptions  # algorithm_options (plug-ins)

    def __init__(self, recipe: ClientRecipe, context: AlgorithmContext):
        self.recipe, self.context = recipe, context
        self.options = self.Options(**recipe.algorithm_options)

    @classmethod
    def check(cls, recipe: ClientRecipe) -> None:
        """Raise ValueError where `recipe` does not fit this algorithm."""
        default = ClientRecipe.model_fields
        ignored = [
            f for f in ALGORITHM_FIELDS
            if f not in cls.uses and getattr(recipe, f) != default[f].default
        ]  # fmt: skip
        if ignored:
            raise ValueError(
                f"client algorithm {recipe.algorithm!r} does not use {', '.join(ignored)}"
            )
        try:
            cls.Options(**recipe.algorithm_options)
        except ValidationError as exc:
            where = f"federated.client.algorithm_options of {recipe.algorithm!r}"
            raise ValueError(format_validation_error(where, exc)) from None

    # Data -------------------------------------------------------------------------------------

    def select_utterances(
        self, utterances: list[Utterance], generator: torch.Generator
    ) -> list[Utterance]:
        """The utterances a client trains on this round (drawn from its keyed "client" stream)."""
        return utterances

    def utterances_used(self, utterances: int) -> int:
        """How many of a user's `utterances` it trains on (for work balancing and bounds)."""
        return utterances

    # Local training, on the group's [G, ...] tensors -------------------------------------------

    def start_group(self, local: LocalUpdate, users: Sequence[str], step: int) -> None:
        """Before the group's first local step; `users[g]` trains in slot g."""

    def perturb(self, local: LocalUpdate, active: list[int]) -> None:
        """Before each forward/backward: change the weights the gradient is taken at."""

    def unperturb(self, local: LocalUpdate) -> None:
        """After each backward, before the step: undo `perturb`."""

    def correct(self, local: LocalUpdate) -> None:
        """Add correction terms to `local.grads` (before the local clip)."""

    # What a client sends, and the server's use of it -------------------------------------------

    def payload_like(self) -> dict[str, torch.Tensor]:
        """Name -> a tensor shaped like each payload entry sent beside Δ (none for FedAvg)."""
        return {}

    def payload_bound(self, update_bound: float) -> float:
        """The largest element of any payload entry or Δ, given Δ's (`update_bound`)."""
        return update_bound

    def payload(
        self, local: LocalUpdate, users: Sequence[str], local_steps: list[int], step: int
    ) -> list[dict[str, torch.Tensor]]:
        """After `local.finish()` (Δ in `local.delta`): per client, its payload entries (views
        valid until the next group)."""
        return [{} for _ in users]

    def server_step(self, averaged: dict[str, torch.Tensor]) -> None:
        """The step's averaged payload entries, after the privacy steps (noise included)."""

    def privacy_note(self) -> str | None:
        """What the record's privacy statement adds about this algorithm's payload."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# The built-in algorithms besides FedAvg: each one hook on top of it.


class FedProx(ClientAlgorithm):
    """Li et al., 2020: the proximal term (μ/2)‖θ − θ_global‖² in every local step."""

    uses = ("fedprox_mu",)

    @classmethod
    def check(cls, recipe: ClientRecipe) -> None:
        super().check(recipe)
        if recipe.fedprox_mu <= 0:
            raise ValueError("client algorithm 'fedprox' needs fedprox_mu > 0")

    @torch.no_grad()
    def correct(self, local: LocalUpdate) -> None:
        # ∇ (μ/2)‖θ − θ_g‖² = μ (θ − θ_g); the delta buffer is free scratch until the end.
        torch._foreach_copy_(local.delta, local.params)
        torch._foreach_sub_(local.delta, local.global_params)
        torch._foreach_add_(local.grads, local.delta, alpha=self.recipe.fedprox_mu)


def variational_noise_std(noise: FederatedVariationalNoise, step: int) -> float:
    """Federated variational noise std at central step `step`, ramped linearly from 0."""
    if noise.ramp_steps == 0:
        return noise.std
    return noise.std * min(1.0, step / noise.ramp_steps)


class VariationalNoise(ClientAlgorithm):
    """Paper 004's federated variational noise: each local gradient is taken at the weights plus
    N(0, std²) (each client's own keyed stream) and applied to the clean weights."""

    uses = ("variational_noise",)

    @classmethod
    def check(cls, recipe: ClientRecipe) -> None:
        super().check(recipe)
        if recipe.variational_noise.std <= 0:
            raise ValueError("client algorithm 'fvn' needs variational_noise.std > 0")

    def start_group(self, local: LocalUpdate, users: Sequence[str], step: int) -> None:
        if not hasattr(self, "clean_weights"):
            self.clean_weights = [torch.empty_like(p) for p in local.params]
        self.std = variational_noise_std(self.recipe.variational_noise, step)
        device = self.context.device
        self.generators = [
            keyed_generator(self.context.seed, step, u, "weights", device=device) for u in users
        ]

    @torch.no_grad()
    def perturb(self, local: LocalUpdate, active: list[int]) -> None:
        """Keep the clean weights, then add noise from each active client's generator (drawn
        into the free delta buffer; other slots get none)."""
        if not self.std:
            return
        torch._foreach_copy_(self.clean_weights, local.params)
        drawing = set(active)
        for i, slot in enumerate(local.delta_slots):
            if i not in drawing:
                torch._foreach_zero_(slot)
                continue
            for noise in slot:
                noise.normal_(0.0, self.std, generator=self.generators[i])
        torch._foreach_add_(local.params, local.delta)

    @torch.no_grad()
    def unperturb(self, local: LocalUpdate) -> None:
        if self.std:
            torch._foreach_copy_(local.params, self.clean_weights)


class DataLimit(ClientAlgorithm):
    """Paper 004's per-round data limit: a random subset of at most `max_utterances`."""

    uses = ("max_utterances",)

    @classmethod
    def check(cls, recipe: ClientRecipe) -> None:
        super().check(recipe)
        if recipe.max_utterances is None:
            raise ValueError("client algorithm 'data-limit' needs max_utterances")

    def select_utterances(
        self, utterances: list[Utterance], generator: torch.Generator
    ) -> list[Utterance]:
        limit = self.recipe.max_utterances
        if len(utterances) <= limit:
            return utterances
        keep = torch.randperm(len(utterances), generator=generator)[:limit].sort().values
        return [utterances[i] for i in keep.tolist()]

    def utterances_used(self, utterances: int) -> int:
        return min(utterances, self.recipe.max_utterances)


# The registry (more built-ins: modules of this package; plug-ins: pflbench.plugins).
CLIENT_ALGORITHMS = ExtensionPoint(
    "client algorithm",
    (
        ("fedavg", ClientAlgorithm),
        ("fedprox", FedProx),
        ("fvn", VariationalNoise),
        ("data-limit", DataLimit),
    ),
    entry_type=ClientAlgorithm,
    classes=True,
)


def check_client_recipe(recipe: ClientRecipe) -> None:
    """The recipe's algorithm is registered and the recipe fits it (UserError otherwise)."""
    algorithm = CLIENT_ALGORITHMS[recipe.algorithm]
    try:
        algorithm.check(recipe)
    except ValueError as exc:
        raise UserError(str(exc)) from None
