"""The client update: local SGD from the global model, returning Δ = θ_global − θ_local.

One `ClientTrainer` per process holds one local model and its buffers; every client reuses them
(the global weights are copied in with one fused op), so memory does not grow with the cohort.
All randomness (batch order, data limit, SpecAugment, dropout/CAPE/layer drop, variational noise)
is keyed by (seed, step, user), so a client's update does not depend on where or when it runs.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pflbench.data.batching import collate, dynamic_batches
from pflbench.data.features import spec_augment
from pflbench.data.store import Utterance
from pflbench.fl.sampling import keyed_generator, keyed_seed
from pflbench.model.transformer import ctc_loss
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


class ClientTrainer:
    """Local SGD on a private copy of the model; `trained` names the tensors clients update."""

    group_size = 1  # clients trained at once (see fl.parallel for more)

    def __init__(
        self,
        global_model: torch.nn.Module,
        trained: list[str],
        recipe: ClientRecipe,
        spec_augment_recipe: SpecAugmentRecipe,
        seed: int,
        device: str,
    ):
        self.model = copy.deepcopy(global_model).to(device)
        self.recipe, self.augment = recipe, spec_augment_recipe
        self.seed, self.device = seed, device
        named = dict(self.model.named_parameters())
        for name, param in named.items():
            param.requires_grad_(name in trained)
        self.names = list(trained)
        self.params = [named[n] for n in trained]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.delta = [torch.empty_like(p) for p in self.params]
        needs_noise = recipe.variational_noise.std > 0
        self.clean_weights = [torch.empty_like(p) for p in self.params] if needs_noise else []
        # Seconds in forward/backward/local update, for `pflbench bench fl`. On CUDA they are
        # only meaningful with `synchronize=True`, which costs a host sync per local step.
        self.compute_seconds = 0.0
        self.synchronize = False

    @torch.no_grad()
    def load_frozen(self, global_model: torch.nn.Module) -> None:
        """Copy every tensor (frozen ones included) from the global model."""
        self.model.load_state_dict(global_model.state_dict())

    @torch.no_grad()
    def _sgd_step(self, global_params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in self.params]
        if self.recipe.fedprox_mu:
            # ∇ (mu/2)‖θ − θ_g‖² = mu (θ − θ_g); the delta buffer is free scratch until the end.
            torch._foreach_copy_(self.delta, self.params)
            torch._foreach_sub_(self.delta, global_params)
            torch._foreach_add_(grads, self.delta, alpha=self.recipe.fedprox_mu)
        torch.nn.utils.clip_grad_norm_(self.params, self.recipe.grad_clip, foreach=True)
        torch._foreach_add_(self.params, grads, alpha=-self.recipe.lr)

    @torch.no_grad()
    def _add_weight_noise(self, std: float, generator: torch.Generator) -> None:
        """Keep the clean weights, then add N(0, std²) (drawn into the free delta buffer)."""
        torch._foreach_copy_(self.clean_weights, self.params)
        for noise in self.delta:
            noise.normal_(0.0, std, generator=generator)
        torch._foreach_add_(self.params, self.delta)

    @torch.no_grad()
    def _restore_clean_weights(self) -> None:
        torch._foreach_copy_(self.params, self.clean_weights)

    def train_group(
        self,
        global_params: list[torch.Tensor],
        clients: list[tuple[str, list[Utterance]]],
        step: int,
    ) -> Iterator[tuple[str, ClientResult]]:
        """One client after the other; yields (user, result), the update valid until the next."""
        for user, utterances in clients:
            yield user, self.train(global_params, utterances, step, user)

    def train(
        self,
        global_params: list[torch.Tensor],
        utterances: list[Utterance],
        step: int,
        user: str,
    ) -> ClientResult:
        """Run the local steps of `user` at central step `step` from `global_params`."""
        plan = plan_client(self.recipe, self.seed, step, user, utterances, self.device)
        utterances, schedule, generator = plan.utterances, plan.schedule, plan.generator
        noise_generator = plan.noise_generator
        torch.manual_seed(plan.model_seed)  # dropout, CAPE, layer drop
        vn_std = variational_noise_std(self.recipe, step) if self.clean_weights else 0.0

        with torch.no_grad():
            torch._foreach_copy_(self.params, global_params)
        self.model.train()
        total_loss, frames = torch.zeros((), device=self.device), 0
        for indices in schedule:
            batch = collate([utterances[i] for i in indices]).to(self.device)
            feats, feat_lens = batch.feats, batch.feat_lens
            if self.augment.enabled:
                feats = spec_augment(feats, feat_lens, generator, **augment_args(self.augment))
            started = clock(self.device, self.synchronize)
            if vn_std:
                self._add_weight_noise(vn_std, noise_generator)
            torch._foreach_zero_([p.grad for p in self.params])
            log_probs, out_lens = self.model(feats, feat_lens)
            loss = ctc_loss(log_probs, out_lens, batch.targets, batch.target_lens)
            loss.backward()
            if vn_std:  # the gradient is taken at the noisy weights and applied to the clean ones
                self._restore_clean_weights()
            self._sgd_step(global_params)
            total_loss += loss.detach()  # no host sync per local step
            self.compute_seconds += clock(self.device, self.synchronize) - started
            frames += sum(u.feats.shape[0] for u in (utterances[i] for i in indices))

        with torch.no_grad():
            torch._foreach_copy_(self.delta, global_params)
            torch._foreach_sub_(self.delta, self.params)
        return ClientResult(
            update=dict(zip(self.names, self.delta, strict=True)),
            loss=total_loss.item() / max(1, len(schedule)),
            local_steps=len(schedule),
            frames=frames,
        )


def augment_args(recipe: SpecAugmentRecipe) -> dict:
    return recipe.model_dump(exclude={"enabled"})
