"""Several clients at once on one device: vmap over stacked client parameters (torch.func).

A small model leaves a GPU idle during one client's local step. `ParallelClientTrainer` trains a
group of G clients in lockstep: local step k of every client in the group is one forward (vmap of
the model over parameters stacked [G, ...]), one CTC over all G·B utterances and one backward,
each client's batch padded to the group's largest (padding utterances weigh 0 in the loss). The
summed loss of independent clients gives each client's slice of the stacked gradient exactly its
own gradient. The loop (keyed batch schedule, SpecAugment), the local update rule (clipping per
local step, SGD; fl.local_update) and the client algorithm's hooks (fl.algorithms) are the ones
one client at a time runs, and CAPE draws come from a generator keyed like the sequential
trainer's global seed, so each update equals the one-at-a-time update up to float rounding (the
padded shapes differ). Dropout and layer drop draw inside the batched model, where no draw can be
keyed per client, so they must be 0 (as in the small presets). Whether this is faster depends on
the device and model: `pflbench bench fl --parallel-clients G` measures it against one client at
a time. It compiles as one client at a time does (fl.client), the vmapped loss one graph, but
one per padded shape: vmap's batching rules of the conv and of the concatenation in the CAPE
embedding fix the batch's sizes, so bucket padding bounds the compilations (beyond
torch.compile's recompile limit, 8, a new shape runs eagerly).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext

import torch
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from pflbench.errors import UserError
from pflbench.fl.algorithms import ClientAlgorithm
from pflbench.fl.client import ClientPlan, ClientTrainer, GroupInputs
from pflbench.model.transformer import ctc_losses
from pflbench.spec.models import SpecAugmentRecipe


class ParallelClientTrainer(ClientTrainer):
    """Local SGD of up to `group_size` clients at once; `trained` names the tensors updated."""

    def __init__(
        self,
        global_model: torch.nn.Module,
        trained: list[str],
        algorithm: ClientAlgorithm,
        spec_augment_recipe: SpecAugmentRecipe,
        seed: int,
        device: str,
        group_size: int,
        compile_backend: str | None = None,
        pad_to_buckets: bool | None = None,
    ):
        cfg = global_model.cfg
        if cfg.dropout or cfg.layer_drop:
            raise UserError(
                f"--parallel-clients needs dropout and layer drop 0 (the model has dropout "
                f"{cfg.dropout}, layer drop {cfg.layer_drop}): their draws cannot be keyed per "
                "client inside a batched step; train one client at a time instead"
            )
        model = copy.deepcopy(global_model).to(device)
        named = dict(model.named_parameters())
        self.frozen = {n: p.detach() for n, p in named.items() if n not in trained}
        # The vmapped forward's leaves: each trained tensor stacked over the group's clients.
        self.stacked = [
            named[n].detach().new_zeros((group_size, *named[n].shape)).requires_grad_()
            for n in trained
        ]
        super().__init__(
            model, trained, algorithm, spec_augment_recipe, seed, device,
            params=[p.detach() for p in self.stacked],
            compile_backend=compile_backend, pad_to_buckets=pad_to_buckets,
        )  # fmt: skip
        self._forward = vmap(self._client_forward)

    def _leaves(self) -> list[torch.Tensor]:
        return self.stacked

    def _stacked(self, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return list(grads)

    def _client_forward(self, params, feats, feat_lens, positions):
        tensors = {**dict(zip(self.names, params, strict=True)), **self.frozen}
        return functional_call(self.model, tensors, (feats, feat_lens, positions))

    @torch.no_grad()
    def load_frozen(self, global_model: torch.nn.Module) -> None:
        named = dict(global_model.named_parameters())
        for name, tensor in self.frozen.items():
            tensor.copy_(named[name])

    def _key_model_draws(self, plans: list[ClientPlan]) -> None:
        # The sequential trainer seeds the global RNG with model_seed; CAPE is its only draw.
        self._position_generators = [
            torch.Generator(self.device).manual_seed(p.model_seed) for p in plans
        ]

    def _group_losses(self, feats, feat_lens, positions, targets, target_lens, weights):
        log_probs, out_lens = self._forward(self.stacked, feats, feat_lens, positions)
        per_utterance = ctc_losses(
            log_probs.flatten(0, 1),
            out_lens.flatten(),
            targets.flatten(0, 1),
            target_lens.flatten(),
        )
        losses = (per_utterance.view_as(weights) * weights).sum(1)
        # An empty slot's loss is 0, even where its dummy utterance's is not finite.
        return torch.where(weights.any(1), losses, 0.0)

    def _forward_backward(self, inputs: GroupInputs) -> torch.Tensor:
        # The fused CUDA attention kernels reject the strides vmap hands them in the backward
        # ("LSE is not correctly aligned"); the math kernel is plain ops that vmap batches.
        cuda = str(self.device).startswith("cuda")
        with warnings.catch_warnings(), sdpa_kernel(SDPBackend.MATH) if cuda else nullcontext():
            # vmap loops over ops without batching rules (e.g. SDPA's backward on CPU)
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            return super()._forward_backward(inputs)
