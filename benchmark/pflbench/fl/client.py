"""The client update: local SGD from the global model, returning Δ = θ_global − θ_local.

`ClientTrainer` is the interface the simulator trains clients through, and the one loop both
trainers share: `SequentialClientTrainer` here (one client at a time) and `ParallelClientTrainer`
(fl.parallel: G clients at once under vmap). The local update rule (local clipping, SGD) is
written once in fl.local_update, and the client algorithm's hooks (fl.algorithms: FedProx,
variational noise, the data limit, SCAFFOLD, plug-ins) are called here, once for both. All
randomness (batch order, data limit, SpecAugment, dropout/CAPE/layer drop, variational noise) is
keyed by (seed, step, user), so a client's update does not depend on where, when or with whom it
trains.

With a compile backend (`pflbench run --compile`), each local step is two graphs of
torch.compile without graph breaks: the group's loss (forward and CTC; its backward compiled
with it; on CUDA with CUDA graphs) and the local update rule (clipping, SGD). Batches are then
padded to a few bucket sizes (data.batching.padded_size) so the graphs see few shapes. The
algorithm's hooks run eagerly between them. The loop itself never waits for the device:
batches are augmented on the host and copied without blocking, and no loop value is read back
(aten's CTC kernels do wait on CUDA: they copy lengths from the host, model.transformer).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pflbench.data.batching import Batch, collate, dynamic_batches, padded_size
from pflbench.data.features import spec_augment
from pflbench.data.store import Utterance
from pflbench.fl.algorithms import ClientAlgorithm
from pflbench.fl.local_update import LocalUpdate
from pflbench.model.compiling import step_compiler, uses_cuda_graphs
from pflbench.model.transformer import cape_positions, ctc_losses
from pflbench.privacy.aggregate import TERMS_PER_PASS, adds_in_one_pass
from pflbench.seeds import keyed_generator, keyed_seed, seed_global_draws
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


class GroupInputs(NamedTuple):
    """A local step's inputs for G clients, padded to common shapes [G, B, ...]."""

    feats: torch.Tensor  # [G, B, T, n_mels]
    feat_lens: torch.Tensor  # [G, B]
    positions: torch.Tensor  # [G, B, T'] CAPE positions (output frames)
    targets: torch.Tensor  # [G, B, L]
    target_lens: torch.Tensor  # [G, B]
    weights: torch.Tensor  # [G, B]: 1/b for a client's b utterances, 0 for padding


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

    A trainer says only how the group's losses are computed (`_group_losses`, on the inputs
    `_group_inputs` builds) and how the model's own draws (dropout, CAPE, layer drop) are keyed
    (`_key_model_draws`). One trainer per process holds one local model and its buffers;
    every group reuses them, so memory does not grow with the cohort.

    `compile_backend` compiles the step (module docstring); `pad_to_buckets` (default: when
    compiled) pads batches to bucket sizes: the same updates up to float rounding, since the
    model masks padded frames and padding utterances weigh 0."""

    def __init__(
        self,
        model: torch.nn.Module,
        trained: list[str],
        algorithm: ClientAlgorithm,
        spec_augment_recipe: SpecAugmentRecipe,
        seed: int,
        device: str,
        params: list[torch.Tensor],
        compile_backend: str | None = None,
        pad_to_buckets: bool | None = None,
    ):
        """`model`: this trainer's own copy; `params`: its trained tensors as [G, ...] views
        (what its forward reads)."""
        self.model = model.train()  # its own copy, only ever trained
        self.names = list(trained)
        self.algorithm = algorithm
        self.recipe, self.augment = algorithm.recipe, spec_augment_recipe
        self.seed, self.device = seed, device
        self.compile_backend = compile_backend
        self.cuda_graphs = uses_cuda_graphs(compile_backend, device)
        compiler = step_compiler(compile_backend, self.cuda_graphs)
        self.pad_to_buckets = compiler is not None if pad_to_buckets is None else pad_to_buckets
        # The update compiles without CUDA graphs: it changes its inputs in place, which CUDA
        # graphs skip anyway, and a second CUDA-graph function would start a new generation of
        # the graphs' memory pool that frees the backward's outputs, the gradients it reads
        # (measured on an H200: "accessing tensor output of CUDAGraphs that has been overwritten").
        # Where the exact sum's C kernel adds (a CPU), Δ buffers in turn keep each update
        # through the next `updates_outlive` results: the sum takes up to TERMS_PER_PASS of
        # them in one pass (ExactSum.add's `held`). Not with payload entries, which lie in the
        # algorithm's own buffers, reused every group, nor for a plug-in's algorithm, whose hooks
        # might keep a Δ buffer they were given as scratch and write into it after its group.
        group_size = params[0].shape[0]
        held = (
            torch.device(device).type == "cpu"
            and adds_in_one_pass()
            and not algorithm.payload_like()
            and type(algorithm).__module__.startswith("pflbench.")
        )
        buffers = 1 + math.ceil((TERMS_PER_PASS - 1) / group_size) if held else 1
        self.updates_outlive = (buffers - 1) * group_size
        self.update = LocalUpdate(
            params, self.recipe, step_compiler(compile_backend), delta_buffers=buffers
        )
        self.group_size = group_size
        self._losses = compiler(self._group_losses) if compiler else self._group_losses
        # CAPE draws per slot: None draws from the global RNG (seeded by _key_model_draws)
        self._position_generators: list[torch.Generator | None] = [None] * self.group_size
        # Seconds in forward/backward/local update, for `pflbench bench fl`. On CUDA they are
        # only meaningful with `synchronize=True`, which costs a host sync per local step.
        self.compute_seconds = 0.0
        self.synchronize = False

    @abstractmethod
    def load_frozen(self, global_model: torch.nn.Module) -> None:
        """Copy the tensors clients do not train from the global model."""

    @abstractmethod
    def _key_model_draws(self, plans: list[ClientPlan]) -> None:
        """Seed the model's own random draws of the group's clients from their `model_seed`
        (CAPE's: `_position_generators`)."""

    @abstractmethod
    def _leaves(self) -> list[torch.Tensor]:
        """The tensors the backward differentiates (the trained ones, as the forward uses them)."""

    @abstractmethod
    def _stacked(self, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The leaves' gradients as [G, ...] tensors, like `update.params` (views, no copy)."""

    @abstractmethod
    def _group_losses(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The [G] clients' mean losses over their real utterances from the GroupInputs (what
        `compile_backend` compiles): tensor operations only."""

    def _group_inputs(self, batches: dict[int, Batch]) -> GroupInputs:
        """The inputs of the clients taking a local step now, {slot: batch (augmented, on the
        device)}: each padded to the group's largest batch, or with `pad_to_buckets` to the
        bucket sizes above it (targets to the output frames); empty slots and padding rows hold
        weight-0 dummy utterances (full length, no target: a finite loss, so 0 · loss adds
        nothing to any gradient). CAPE positions are drawn at each client's own batch shape, so
        padding moves no draw."""
        G, cfg, dev = self.group_size, self.model.cfg, self.device
        B = max(b.feats.shape[0] for b in batches.values())
        T = max(b.feats.shape[1] for b in batches.values())
        L = max(1, max(b.targets.shape[1] for b in batches.values()))
        if self.pad_to_buckets:
            B, T = padded_size(B), padded_size(T)
        out_frames = int(self.model.output_lengths(torch.tensor(T)))
        if self.pad_to_buckets:  # targets as wide as CTC can align: no shape of their own
            L = max(L, out_frames)
        feats = torch.zeros(G, B, T, cfg.n_mels, device=dev)
        feat_lens = torch.full((G, B), T, dtype=torch.int64, device=dev)
        positions = torch.zeros(G, B, out_frames, device=dev)
        targets = torch.zeros(G, B, L, dtype=torch.int64, device=dev)
        target_lens = torch.zeros(G, B, dtype=torch.int64, device=dev)
        weights = torch.zeros(G, B, device=dev)
        for g, batch in batches.items():
            b, t = batch.feats.shape[:2]
            feats[g, :b, :t] = batch.feats
            feat_lens[g, :b] = batch.feat_lens
            own_lens = self.model.output_lengths(batch.feat_lens)
            own_frames = int(self.model.output_lengths(torch.tensor(t)))
            positions[g, :b, :own_frames] = cape_positions(
                own_lens, own_frames, cfg, True, generator=self._position_generators[g]
            )
            targets[g, :b, : batch.targets.shape[1]] = batch.targets
            target_lens[g, :b] = batch.target_lens
            weights[g, :b] = 1.0 / b
        return GroupInputs(feats, feat_lens, positions, targets, target_lens, weights)

    def _forward_backward(self, inputs: GroupInputs) -> torch.Tensor:
        """Forward and backward of the group (its gradients handed to `update`); returns the
        [G] clients' losses, detached. The clients are independent, so the backward of their sum
        gives each client's slice of the stacked gradient exactly its own gradient. The gradients
        are the backward's own new tensors: no buffer to zero before it or to add them into."""
        if self.compile_backend is not None:
            # The batch dimensions vary: one graph for all their sizes (and one for a single
            # utterance, which torch.compile always specializes), not one per size.
            for tensor in inputs:
                for dim in range(1, tensor.dim() - (tensor is inputs.feats)):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        if self.cuda_graphs:  # the last step's graph outputs (losses, gradients) are consumed
            torch.compiler.cudagraph_mark_step_begin()
        losses = self._losses(*inputs)
        # A block that layer drop skipped is not in the graph: its gradient is zero (a plain
        # local SGD step leaves it where it is, as an optimizer skips a None gradient).
        grads = torch.autograd.grad(
            losses.sum(), self._leaves(), allow_unused=True, materialize_grads=True
        )
        self.update.take_grads(self._stacked(grads))
        return losses.detach()

    def train_group(
        self,
        global_params: list[torch.Tensor],
        clients: list[tuple[str, list[Utterance]]],
        step: int,
    ) -> Iterator[tuple[str, ClientResult]]:
        """Train `clients` (user, utterances) at central step `step`, `group_size` at a time;
        yields (user, result) in order, a result's update a view valid until the next group, and
        through the next `updates_outlive` results at least."""
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
        total_loss = torch.zeros(self.group_size, device=self.device)
        frames = [0] * len(plans)
        for k in range(max(len(p.schedule) for p in plans)):
            active = [g for g, p in enumerate(plans) if k < len(p.schedule)]
            idle = [g for g in range(self.group_size) if g not in active]
            batches = {}
            for g in active:
                plan = plans[g]
                batch = collate([plan.utterances[i] for i in plan.schedule[k]])
                frames[g] += int(batch.feat_lens.sum())
                if self.augment.enabled:  # on the host, before the copy: no device sync
                    args = augment_args(self.augment)
                    feats = spec_augment(batch.feats, batch.feat_lens, plan.generator, **args)
                    batch = dataclasses.replace(batch, feats=feats)
                batches[g] = batch.to(self.device, non_blocking=True)
            inputs = self._group_inputs(batches)
            started = clock(self.device, self.synchronize)
            algorithm.perturb(self.update, active)
            losses = self._forward_backward(inputs)
            algorithm.unperturb(self.update)
            algorithm.correct(self.update)
            self.update.step(idle)
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
        compile_backend: str | None = None,
        pad_to_buckets: bool | None = None,
    ):
        model = copy.deepcopy(global_model).to(device)
        named = dict(model.named_parameters())
        for name, param in named.items():
            param.requires_grad_(name in trained)
        self.leaves = [named[n] for n in trained]
        super().__init__(
            model, trained, algorithm, spec_augment_recipe, seed, device,
            params=[p.detach().unsqueeze(0) for p in self.leaves],
            compile_backend=compile_backend, pad_to_buckets=pad_to_buckets,
        )  # fmt: skip

    def _leaves(self) -> list[torch.Tensor]:
        return self.leaves

    def _stacked(self, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return [g.unsqueeze(0) for g in grads]

    @torch.no_grad()
    def load_frozen(self, global_model: torch.nn.Module) -> None:
        self.model.load_state_dict(global_model.state_dict())

    def _key_model_draws(self, plans: list[ClientPlan]) -> None:
        # CAPE (drawn first, by _group_inputs), then dropout and layer drop in the forward
        seed_global_draws(plans[0].model_seed, self.device)

    def _group_losses(self, feats, feat_lens, positions, targets, target_lens, weights):
        log_probs, out_lens = self.model(feats[0], feat_lens[0], positions[0])
        per_utterance = ctc_losses(log_probs, out_lens, targets[0], target_lens[0])
        if self.pad_to_buckets:  # padding rows weigh 0
            return (per_utterance * weights[0]).sum().view(1)
        return per_utterance.mean().view(1)


def augment_args(recipe: SpecAugmentRecipe) -> dict:
    return recipe.model_dump(exclude={"enabled"})
