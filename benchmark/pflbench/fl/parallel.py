"""Several clients at once on one device: vmap over stacked client parameters (torch.func).

A small model leaves a GPU idle during one client's local step. `ParallelClientTrainer` trains a
group of G clients in lockstep: local step k of every client in the group is one forward (vmap of
the model over parameters stacked [G, ...]), one CTC over all G·B utterances and one backward,
each client's batch padded to the group's largest (padding utterances weigh 0 in the loss). The
summed loss of independent clients gives each client's slice of the stacked gradient exactly its
own gradient. Each client does exactly what `ClientTrainer`
does — its keyed batch schedule, SpecAugment, CAPE draws (from a generator keyed like the
sequential trainer's global seed), variational noise, FedProx, clipping per local step, SGD — so
its update equals the one-at-a-time update up to float rounding (the padded shapes differ).
Dropout and layer drop draw inside the batched model, where no draw can be keyed per client, so
they must be 0 (as in the small presets). Whether this is faster depends on the device and model:
`pflbench bench fl --parallel-clients G` measures it against one client at a time.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from pflbench.data.batching import collate
from pflbench.data.features import spec_augment
from pflbench.data.store import Utterance
from pflbench.errors import UserError
from pflbench.fl.client import (
    ClientResult,
    augment_args,
    clock,
    plan_client,
    variational_noise_std,
)
from pflbench.model.transformer import cape_positions, ctc_losses
from pflbench.spec.models import ClientRecipe, SpecAugmentRecipe


class ParallelClientTrainer:
    """Local SGD of up to `group_size` clients at once; `trained` names the tensors updated."""

    def __init__(
        self,
        global_model: torch.nn.Module,
        trained: list[str],
        recipe: ClientRecipe,
        spec_augment_recipe: SpecAugmentRecipe,
        seed: int,
        device: str,
        group_size: int,
    ):
        cfg = global_model.cfg
        if cfg.dropout or cfg.layer_drop:
            raise UserError(
                f"--parallel-clients needs dropout and layer drop 0 (the model has dropout "
                f"{cfg.dropout}, layer drop {cfg.layer_drop}): their draws cannot be keyed per "
                "client inside a batched step; train one client at a time instead"
            )
        self.model = copy.deepcopy(global_model).to(device)
        self.recipe, self.augment = recipe, spec_augment_recipe
        self.seed, self.device, self.group_size = seed, device, group_size
        self.names = list(trained)
        named = dict(self.model.named_parameters())
        self.frozen = {n: p.detach() for n, p in named.items() if n not in trained}
        self.params = [
            named[n].detach().new_zeros((group_size, *named[n].shape)).requires_grad_()
            for n in trained
        ]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.delta = [torch.empty_like(p) for p in self.params]
        needs_noise = recipe.variational_noise.std > 0
        self.clean_weights = [torch.empty_like(p) for p in self.params] if needs_noise else []
        self.compute_seconds = 0.0
        self.synchronize = False
        self._forward = vmap(self._client_forward)

    def _client_forward(self, params, feats, feat_lens, positions):
        tensors = {**dict(zip(self.names, params, strict=True)), **self.frozen}
        return functional_call(self.model, tensors, (feats, feat_lens, positions))

    def _losses(self, feats, feat_lens, positions, targets, target_lens, weights) -> torch.Tensor:
        """[G] each client's mean loss over its real utterances."""
        # The fused CUDA attention kernels reject the strides vmap hands them in the backward
        # ("LSE is not correctly aligned"); the math kernel is plain ops that vmap batches.
        cuda = str(self.device).startswith("cuda")
        with warnings.catch_warnings(), sdpa_kernel(SDPBackend.MATH) if cuda else nullcontext():
            # vmap loops over ops without batching rules (e.g. SDPA's backward on CPU)
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            log_probs, out_lens = self._forward(self.params, feats, feat_lens, positions)
        per_utterance = ctc_losses(
            log_probs.flatten(0, 1),
            out_lens.flatten(),
            targets.flatten(0, 1),
            target_lens.flatten(),
        )
        return (per_utterance.view_as(weights) * weights).sum(1)

    @torch.no_grad()
    def load_frozen(self, global_model: torch.nn.Module) -> None:
        named = dict(global_model.named_parameters())
        for name, tensor in self.frozen.items():
            tensor.copy_(named[name])

    def train_group(
        self,
        global_params: list[torch.Tensor],
        clients: list[tuple[str, list[Utterance]]],
        step: int,
    ) -> Iterator[tuple[str, ClientResult]]:
        """Train `clients` (user, utterances) at central step `step` together; yields
        (user, result) per client; a result's update is a view valid until the next group."""
        if not 0 < len(clients) <= self.group_size:
            raise ValueError(f"a group holds 1..{self.group_size} clients, got {len(clients)}")
        n = len(clients)
        model_cfg = self.model.cfg
        plans = [plan_client(self.recipe, self.seed, step, u, x, self.device) for u, x in clients]
        schedules = [p.schedule for p in plans]
        data = [p.utterances for p in plans]
        generators = [p.generator for p in plans]
        noise_generators = [p.noise_generator for p in plans]
        # The sequential trainer seeds the global RNG with model_seed; CAPE is its only draw.
        position_generators = [
            torch.Generator(self.device).manual_seed(p.model_seed) for p in plans
        ]
        vn_std = variational_noise_std(self.recipe, step) if self.clean_weights else 0.0

        with torch.no_grad():
            for stacked, global_tensor in zip(self.params, global_params, strict=True):
                stacked.copy_(global_tensor.expand_as(stacked))
        self.model.train()
        total_loss = torch.zeros(self.group_size, device=self.device)
        frames = [0] * n
        for k in range(max(len(s) for s in schedules)):
            active = [g for g in range(n) if k < len(schedules[g])]
            batches = {}
            for g in active:
                batch = collate([data[g][i] for i in schedules[g][k]])
                frames[g] += int(batch.feat_lens.sum())  # before the copy: no device sync
                batch = batch.to(self.device)
                feats = batch.feats
                if self.augment.enabled:
                    feats = spec_augment(
                        feats, batch.feat_lens, generators[g], **augment_args(self.augment)
                    )
                batches[g] = (batch, feats)
            inputs = self._stack(batches, model_cfg, position_generators)
            mask = torch.zeros(self.group_size, device=self.device)
            mask[active] = 1.0
            started = clock(self.device, self.synchronize)
            if vn_std:
                self._add_weight_noise(vn_std, active, noise_generators)
            torch._foreach_zero_([p.grad for p in self.params])
            losses = self._losses(*inputs)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*performance drop.*")
                losses.sum().backward()
            if vn_std:  # the gradient is taken at the noisy weights and applied to the clean ones
                with torch.no_grad():
                    torch._foreach_copy_(self.params, self.clean_weights)
            self._sgd_step([p.grad for p in self.params], global_params, mask)
            total_loss += torch.where(mask.bool(), losses.detach(), 0.0)
            self.compute_seconds += clock(self.device, self.synchronize) - started

        with torch.no_grad():
            for delta, stacked, global_tensor in zip(
                self.delta, self.params, global_params, strict=True
            ):
                torch.sub(global_tensor.expand_as(stacked), stacked.detach(), out=delta)
        losses = total_loss.tolist()
        for g, (user, _) in enumerate(clients):
            yield (
                user,
                ClientResult(
                    update={name: d[g] for name, d in zip(self.names, self.delta, strict=True)},
                    loss=losses[g] / max(1, len(schedules[g])),
                    local_steps=len(schedules[g]),
                    frames=frames[g],
                ),
            )

    def _stack(self, batches: dict, cfg, position_generators) -> tuple[torch.Tensor, ...]:
        """The group's inputs [G, B, ...], padded; empty slots hold weight-0 dummy utterances
        (full length, no target: a finite loss, so 0 · loss adds nothing to any gradient)."""
        G = self.group_size
        B = max(b.feats.shape[0] for b, _ in batches.values())
        T = max(b.feats.shape[1] for b, _ in batches.values())
        L = max(b.targets.shape[1] for b, _ in batches.values())
        out_frames = int(self.model.output_lengths(torch.tensor(T)))
        dev = self.device
        feats = torch.zeros(G, B, T, cfg.n_mels, device=dev)
        feat_lens = torch.full((G, B), T, dtype=torch.int64, device=dev)
        positions = torch.zeros(G, B, out_frames, device=dev)
        targets = torch.zeros(G, B, max(L, 1), dtype=torch.int64, device=dev)
        target_lens = torch.zeros(G, B, dtype=torch.int64, device=dev)
        weights = torch.zeros(G, B, device=dev)
        for g, (batch, augmented) in batches.items():
            b, t = augmented.shape[:2]
            feats[g, :b, :t] = augmented
            feat_lens[g, :b] = batch.feat_lens
            own_lens = self.model.output_lengths(batch.feat_lens)
            own_frames = int(self.model.output_lengths(torch.tensor(t)))
            positions[g, :b, :own_frames] = cape_positions(
                own_lens, own_frames, cfg, True, generator=position_generators[g]
            )
            targets[g, :b, : batch.targets.shape[1]] = batch.targets
            target_lens[g, :b] = batch.target_lens
            weights[g, :b] = 1.0 / b
        return feats, feat_lens, positions, targets, target_lens, weights

    @torch.no_grad()
    def _sgd_step(self, grads, global_params, mask: torch.Tensor) -> None:
        """Per client: FedProx, clip the local gradient to C_loc (as clip_grad_norm_), SGD.
        Clients whose schedule has ended (mask 0) get a zero gradient: not even a NaN in a
        padding slot can move them."""
        if self.recipe.fedprox_mu:
            for grad, stacked, global_tensor in zip(grads, self.params, global_params, strict=True):
                grad.add_(stacked - global_tensor, alpha=self.recipe.fedprox_mu)
        for grad in grads:
            grad.masked_fill_(~mask.bool().view(-1, *([1] * (grad.dim() - 1))), 0.0)
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1) for g in grads])
        total = torch.linalg.vector_norm(norms, dim=0)
        coef = (self.recipe.grad_clip / (total + 1e-6)).clamp(max=1.0)
        for grad, stacked in zip(grads, self.params, strict=True):
            scale = (-self.recipe.lr * coef).view(-1, *([1] * (grad.dim() - 1)))
            stacked.addcmul_(grad, scale)

    @torch.no_grad()
    def _add_weight_noise(self, std: float, active: list[int], generators) -> None:
        """Keep the clean weights, then add each active client's keyed N(0, std²) noise."""
        torch._foreach_copy_(self.clean_weights, self.params)
        for noise in self.delta:
            noise.zero_()
        for g in active:
            for noise in self.delta:
                noise[g].normal_(0.0, std, generator=generators[g])
        torch._foreach_add_(self.params, self.delta)
