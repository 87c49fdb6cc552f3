"""The client update: local SGD from the global model, returning Δ = θ_global − θ_local.

`ClientTrainer` is the interface the simulator trains clients through, and the one loop both
trainers share: `SequentialClientTrainer` here (one client at a time) and `ParallelClientTrainer`
(fl.parallel: G clients at once under vmap). The local update rule (local clipping, SGD) is
written once in fl.local_update, and the client algorithm's hooks (fl.algorithms: FedProx,
variational noise, the data limit, SCAFFOLD, plug-ins) are called here, once for both. All
randomness (batch order, data limit, SpecAugment, dropout/CAPE/layer drop, variational noise) is
keyed by (seed, step, user), so a client's update does not depend on where, when or with whom it
trains.
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
from pflbench.fl.algorithms import ClientAlgorithm
from pflbench.fl.local_update import LocalUpdate
from pflbench.model.transformer import ctc_loss
from pflbench.seeds import keyed_generator, keyed_seed
from pflbench.spec.models import ClientRecipe, SpecAugmentRecipe


@dataclass
class ClientResult:
    # Δ per trained tensor, then the algorithm's payload entries: views of reused buffers
    update: dict[str, torch.Tensor]
    loss: float  # mean training loss over the local steps
    local_steps: int
    frames: int  # input feature frames processed (for throughput and MFU)


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

    utterances: list[Utterance]  # the algorithm's selection (e.g. the data limit)
    schedule: list[list[int]]  # the local batches
    generator: torch.Generator  # "client" stream, next used by SpecAugment
    model_seed: int  # the model's own draws: dropout, CAPE, layer drop


def plan_client(
    algorithm: ClientAlgorithm, seed: int, step: int, user: str, utterances: list[Utterance]
) -> ClientPlan:
    generator = keyed_generator(seed, step, user, "client")
    utterances = algorithm.select_utterances(utterances, generator)
    return ClientPlan(
        utterances=utterances,
        schedule=local_batches([u.seconds for u in utterances], algorithm.recipe, generator),
        generator=generator,
        model_seed=keyed_seed(seed, step, user, "model"),
    )


def clock(device: str, synchronize: bool) -> float:
    """perf_counter, after waiting for the device's queued work when asked (CUDA is async)."""
    if synchronize and str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


class ClientTrainer(ABC):
    """Local SGD of up to `group_size` clients at once, each from the global weights; `trained`
    names the tensors clients update. Both trainers run the same loop: each client's keyed plan,
    batches and SpecAugment, then per local step one forward/backward of the group and one step
    of the local update rule (fl.local_update) on the trained tensors stacked [G, ...], with the
    client algorithm's hooks (fl.algorithms) around them.

    A trainer says only how the group's forward and backward run (`_forward_backward`, on the
    inputs `_group_inputs` builds) and how the model's own draws (dropout, CAPE, layer drop) are
    keyed (`_key_model_draws`). One trainer per process holds one local model and its buffers;
    every group reuses them, so memory does not grow with the cohort."""

    def __init__(
        self,
        model: torch.nn.Module,
        trained: list[str],
        algorithm: ClientAlgorithm,
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
        self.algorithm = algorithm
        self.recipe, self.augment = algorithm.recipe, spec_augment_recipe
        self.seed, self.device = seed, device
        self.update = LocalUpdate(params, grads, self.recipe)
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
        algorithm, users = self.algorithm, [u for u, _ in clients]
        plans = [plan_client(algorithm, self.seed, step, u, x) for u, x in clients]
        self._key_model_draws(plans)

        self.update.start(global_params)
        algorithm.start_group(self.update, users, step)
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
            algorithm.perturb(self.update, active)
            self.update.zero_grad()
            losses = self._forward_backward(inputs)
            algorithm.unperturb(self.update)
            algorithm.correct(self.update)
            self.update.step(idle)
            if idle:
                losses[idle] = 0.0
            total_loss += losses  # no host sync per local step
            self.compute_seconds += clock(self.device, self.synchronize) - started

        deltas = self.update.finish()
        steps_taken = [len(p.schedule) for p in plans]
        payloads = algorithm.payload(self.update, users, steps_taken, step)
        losses = total_loss.tolist()
        for g, user in enumerate(users):
            steps = steps_taken[g]
            update = {name: d[g] for name, d in zip(self.names, deltas, strict=True)}
            yield (
                user,
                ClientResult(
                    update=update | payloads[g],
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
        algorithm: ClientAlgorithm,
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
            model, trained, algorithm, spec_augment_recipe, seed, device,
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
