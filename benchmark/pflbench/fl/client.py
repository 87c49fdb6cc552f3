"""The client update: local SGD from the global model, returning Δ = θ_global − θ_local.

`ClientTrainer` is the interface the simulator trains clients through, and the one loop both
trainers share: `SequentialClientTrainer` here (one client at a time) and `ParallelClientTrainer`
(fl.parallel: G clients at once under vmap). The local update rule itself (FedProx, local
clipping, SGD, variational weight noise) is written once in fl.local_update. All randomness
(batch order, data limit, SpecAugment, dropout/CAPE/layer drop, variational noise) is keyed by
(seed, step, user), so a client's update does not depend on where, when or with whom it trains.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pflbench.data.batching import Batch, collate, dynamic_batches
from pflbench.data.features import spec_augment
from pflbench.data.store import Utterance
from pflbench.fl.local_update import LocalUpdate
from pflbench.model.transformer import ctc_loss
from pflbench.seeds import keyed_generator, keyed_seed
from pflbench.spec.models import ClientRecipe, SpecAugmentRecipe


@dataclass
class ClientResult:
    update: dict[str, torch.Tensor]  # Δ per trained tensor: views of the trainer's reused buffer
    loss: float  # mean training loss over the local steps
    local_steps: int
    frames: int  # input feature frames processed (for throughput and MFU)


def limit_utterances(
    utterances: list[Utterance], max_utterances: int | None, generator: torch.Generator
) -> list[Utterance]:
    """Paper 004's per-round data limit: a random subset of at most `max_utterances`."""
    if max_utterances is None or len(utterances) <= max_utterances:
        return utterances
    keep = torch.randperm(len(utterances), generator=generator)[:max_utterances].sort().values
    return [utterances[i] for i in keep.tolist()]


def local_batches(
    seconds: list[float], recipe: ClientRecipe, generator: torch.Generator
) -> list[list[int]]:
    """The local schedule: `local_steps` batches (reshuffled epochs, cycled as needed), or
    `local_epochs` passes over the data, each a fresh dynamic batching of ≤ batch_seconds."""
    batches: list[list[int]] = []
    if not seconds:
        return batches
    epochs = recipe.local_epochs or 0
    while (recipe.local_steps and len(batches) < recipe.local_steps) or epochs > 0:
        batches += dynamic_batches(seconds, recipe.batch_seconds, generator)
        epochs -= 1
    return batches[: recipe.local_steps] if recipe.local_steps else batches


@dataclass
class ClientPlan:
    """What a client's keys fix before its first local step; both trainers start from it."""

    utterances: list[Utterance]  # after the data limit
    schedule: list[list[int]]  # the local batches
    generator: torch.Generator  # "client" stream, next used by SpecAugment
    noise_generator: torch.Generator  # variational weight noise
    model_seed: int  # the model's own draws: dropout, CAPE, layer drop


def plan_client(
    recipe: ClientRecipe, seed: int, step: int, user: str, utterances: list[Utterance], device
) -> ClientPlan:
    generator = keyed_generator(seed, step, user, "client")
    utterances = limit_utterances(utterances, recipe.max_utterances, generator)
    return ClientPlan(
        utterances=utterances,
        schedule=local_batches([u.seconds for u in utterances], recipe, generator),
        generator=generator,
        noise_generator=keyed_generator(seed, step, user, "weights", device=device),
        model_seed=keyed_seed(seed, step, user, "model"),
    )


def clock(device: str, synchronize: bool) -> float:
    """perf_counter, after waiting for the device's queued work when asked (CUDA is async)."""
    if synchronize and str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


def variational_noise_std(recipe: ClientRecipe, step: int) -> float:
    """Federated variational noise std at central step `step`, ramped linearly from 0."""
    vn = recipe.variational_noise
    if vn.ramp_steps == 0:
        return vn.std
    return vn.std * min(1.0, step / vn.ramp_steps)


class ClientTrainer(ABC):
    """Local SGD of up to `group_size` clients at once, each from the global weights; `trained`
    names the tensors clients update. Both trainers run the same loop: each client's keyed plan,
    batches and SpecAugment, then per local step one forward/backward of the group and one step
    of the local update rule (fl.local_update) on the trained tensors stacked [G, ...].

    A trainer says only how the group's forward and backward run (`_forward_backward`, on the
    inputs `_group_inputs` builds) and how the model's own draws (dropout, CAPE, layer drop) are
    keyed (`_key_model_draws`). One trainer per process holds one local model and its buffers;
    every group reuses them, so memory does not grow with the cohort."""

    def __init__(
        self,
        model: torch.nn.Module,
        trained: list[str],
        recipe: ClientRecipe,
        spec_augment_recipe: SpecAugmentRecipe,
        seed: int,
        device: str,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
    ):
        """`model`: this trainer's own copy; `params`/`grads`: its trained tensors and their
        gradients as [G, ...] views (what its forward reads and its backward accumulates into)."""
        self.model = model
        self.names = list(trained)
        self.recipe, self.augment = recipe, spec_augment_recipe
        self.seed, self.device = seed, device
        self.update = LocalUpdate(params, grads, recipe)
        self.group_size = self.update.group_size
        # Seconds in forward/backward/local update, for `pflbench bench fl`. On CUDA they are
        # only meaningful with `synchronize=True`, which costs a host sync per local step.
        self.compute_seconds = 0.0
        self.synchronize = False

    @abstractmethod
    def load_frozen(self, global_model: torch.nn.Module) -> None:
        """Copy the tensors clients do not train from the global model."""

    @abstractmethod
    def _key_model_draws(self, plans: list[ClientPlan]) -> None:
        """Seed the model's own random draws of the group's clients from their `model_seed`."""

    @abstractmethod
    def _group_inputs(self, batches: dict[int, tuple[Batch, torch.Tensor]]):
        """The forward's inputs from {slot: (batch, augmented feats)} of the clients that take a
        local step now (on the device)."""

    @abstractmethod
    def _forward_backward(self, inputs) -> torch.Tensor:
        """Forward and backward of the group (gradients into `update.grads`); returns the [G]
        clients' losses, detached."""

    def train_group(
        self,
        global_params: list[torch.Tensor],
        clients: list[tuple[str, list[Utterance]]],
        step: int,
    ) -> Iterator[tuple[str, ClientResult]]:
        """Train `clients` (user, utterances) at central step `step`, `group_size` at a time;
        yields (user, result) in order, a result's update a view valid until the next group."""
        for first in range(0, len(clients), self.group_size):
            group = clients[first : first + self.group_size]
            yield from self._train_together(global_params, group, step)

    def _train_together(
        self,
        global_params: list[torch.Tensor],
        clients: list[tuple[str, list[Utterance]]],
        step: int,
    ) -> Iterator[tuple[str, ClientResult]]:
        plans = [plan_client(self.recipe, self.seed, step, u, x, self.device) for u, x in clients]
        self._key_model_draws(plans)
        noise_generators = [p.noise_generator for p in plans]
        vn_std = variational_noise_std(self.recipe, step) if self.update.clean_weights else 0.0

        self.update.start(global_params)
        self.model.train()
        total_loss = torch.zeros(self.group_size, device=self.device)
        frames = [0] * len(plans)
        for k in range(max(len(p.schedule) for p in plans)):
            active = [g for g, p in enumerate(plans) if k < len(p.schedule)]
            idle = [g for g in range(self.group_size) if g not in active]
            batches = {}
            for g in active:
                plan = plans[g]
                batch = collate([plan.utterances[i] for i in plan.schedule[k]])
                frames[g] += int(batch.feat_lens.sum())  # before the copy: no device sync
                batch = batch.to(self.device)
                feats = batch.feats
                if self.augment.enabled:
                    args = augment_args(self.augment)
                    feats = spec_augment(feats, batch.feat_lens, plan.generator, **args)
                batches[g] = (batch, feats)
            inputs = self._group_inputs(batches)
            started = clock(self.device, self.synchronize)
            if vn_std:
                self.update.add_weight_noise(vn_std, active, noise_generators)
            self.update.zero_grad()
            losses = self._forward_backward(inputs)
            if vn_std:  # the gradient is taken at the noisy weights and applied to the clean ones
                self.update.restore_clean_weights()
            self.update.step(idle)
            if idle:
                losses[idle] = 0.0
            total_loss += losses  # no host sync per local step
            self.compute_seconds += clock(self.device, self.synchronize) - started

        deltas = self.update.finish()
        losses = total_loss.tolist()
        for g, (user, _) in enumerate(clients):
            steps = len(plans[g].schedule)
            yield (
                user,
                ClientResult(
                    update={name: d[g] for name, d in zip(self.names, deltas, strict=True)},
                    loss=losses[g] / max(1, steps),
                    local_steps=steps,
                    frames=frames[g],
                ),
            )


class SequentialClientTrainer(ClientTrainer):
    """One client at a time (G = 1) on a private copy of the model: its own forward, so any
    model (dropout and layer drop included) trains; the draws come from the global RNG, seeded
    per client."""

    def __init__(
        self,
        global_model: torch.nn.Module,
        trained: list[str],
        recipe: ClientRecipe,
        spec_augment_recipe: SpecAugmentRecipe,
        seed: int,
        device: str,
    ):
        model = copy.deepcopy(global_model).to(device)
        named = dict(model.named_parameters())
        for name, param in named.items():
            param.requires_grad_(name in trained)
        leaves = [named[n] for n in trained]
        for p in leaves:
            p.grad = torch.zeros_like(p)  # backward accumulates into these very tensors
        super().__init__(
            model, trained, recipe, spec_augment_recipe, seed, device,
            params=[p.detach().unsqueeze(0) for p in leaves],
            grads=[p.grad.unsqueeze(0) for p in leaves],
        )  # fmt: skip

    @torch.no_grad()
    def load_frozen(self, global_model: torch.nn.Module) -> None:
        self.model.load_state_dict(global_model.state_dict())

    def _key_model_draws(self, plans: list[ClientPlan]) -> None:
        torch.manual_seed(plans[0].model_seed)  # dropout, CAPE, layer drop

    def _group_inputs(self, batches: dict[int, tuple[Batch, torch.Tensor]]):
        return batches[0]

    def _forward_backward(self, inputs: tuple[Batch, torch.Tensor]) -> torch.Tensor:
        batch, feats = inputs
        log_probs, out_lens = self.model(feats, batch.feat_lens)
        loss = ctc_loss(log_probs, out_lens, batch.targets, batch.target_lens)
        loss.backward()
        return loss.detach().view(1)


def augment_args(recipe: SpecAugmentRecipe) -> dict:
    return recipe.model_dump(exclude={"enabled"})
