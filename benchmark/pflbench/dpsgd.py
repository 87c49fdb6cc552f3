"""Example-level DP-SGD (paper 003) with opacus: the seed model fine-tuned on the pooled federated
training data, each example's gradient clipped and the sum noised.

    per step t:  batch = Poisson sample of the N examples at q = B/N    (privacy.sampling)
                 g_i   = per-example gradients                           (GradSampleModule)
                 ĝ     = (Σ_i clip_C(g_i) + N(0, z²C²)) / B              (opacus DPOptimizer)
                 θ    ← the fine_tune optimizer's step with ĝ, at fine_tune's lr schedule

Clipping is opacus': global (DPOptimizer, ‖g_i‖ ≤ C) or per tensor (DPPerLayerOptimizer,
‖g_i,h‖ ≤ C_h with pflbench's per-layer allocation, privacy.clipping.layer_bounds, over the
trained tensors). Opacus' hook-based grad samplers cover every parameter of the CTC transformer
(Linear, Conv1d, LayerNorm; attention is parameter-free); a module without one would get opacus'
functorch sampler. Every trained tensor must get a per-example gradient: a tensor that has a
gradient but none per example is an error, never left out of the clipping; a tensor whose module
did not run (layer drop) has a zero gradient for every example. Frozen tensors (layer freezing)
are not trained, clipped or noised.

The Poisson batch is drawn from the step's keyed stream (pflbench.privacy.sampling, the one the
federated cohorts come from), not by opacus' DPDataLoader, so that a run and its resume draw the
same batches; the noise comes from the step's keyed generator (privacy.noise), the SpecAugment
masks, CAPE positions and dropout from the step's seeds as in central training. A batch is
processed in chunks of at most `example_dp.physical_batch` examples, accumulated by opacus
(signal_skip_step, as its BatchMemoryManager does).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from pflbench.central import load_optimizer_tensors, optimizer_tensors, step_decay_lr
from pflbench.data.batching import chunks, collate
from pflbench.data.features import spec_augment as apply_spec_augment
from pflbench.data.store import Utterance
from pflbench.model.optim import make_central_optimizer
from pflbench.model.transformer import CTCTransformer, ctc_losses
from pflbench.privacy.clipping import layer_bounds
from pflbench.privacy.noise import noise_generator
from pflbench.privacy.sampling import sample_cohort
from pflbench.seeds import keyed_seed
from pflbench.spec.models import Recipe


class ExampleDPSGD:
    """One example-level DP-SGD run's trainer: `run_step` takes one step; `state_dict` and
    `load_state_dict` hold what a resumed run needs (the model, the optimizer, the step)."""

    def __init__(
        self,
        model: CTCTransformer,
        utterances: list[Utterance],
        recipe: Recipe,
        noise_multiplier: float,
        batch: int,
        seed: int,
        device: str,
        trained: list[str],
    ):
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer

        self.model = model.to(device).train()
        self.utterances = utterances
        self.schedule = recipe.fine_tune or recipe.central
        self.spec_augment = recipe.spec_augment
        self.physical_batch = recipe.example_dp.physical_batch
        self.batch = batch
        self.seed = seed
        self.device = device
        self.step = 0
        named = dict(model.named_parameters())
        for name, param in named.items():
            param.requires_grad_(name in trained)
        self.trained = [named[name] for name in trained]
        self.module = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        inner = make_central_optimizer(model.named_parameters(), self.schedule)
        privacy = recipe.privacy
        common = {
            "noise_multiplier": noise_multiplier,
            "expected_batch_size": batch,
            "loss_reduction": "mean",  # the noised sum divided by B
        }
        if privacy.clipping == "global":
            self.bounds = None
            self.optimizer = DPOptimizer(inner, max_grad_norm=privacy.clip_bound, **common)
        else:
            sizes = [named[name].numel() for name in trained]
            by_tensor = dict(zip(trained, layer_bounds(sizes, privacy.clip_bound,
                                                       privacy.perlayer_mode).tolist(),
                                 strict=True))  # fmt: skip
            name_of = {id(param): name for name, param in named.items()}
            ordered = [by_tensor[name_of[id(p)]] for g in inner.param_groups for p in g["params"]]
            self.bounds = torch.tensor([by_tensor[name] for name in trained], dtype=torch.float64)
            self.optimizer = DPPerLayerOptimizer(inner, max_grad_norm=ordered, **common)
        self.clip_bound = privacy.clip_bound

    # ------------------------------------------------------------------------------------------

    def run_step(self) -> dict:
        """One DP-SGD step; returns its loss (mean over the batch), lr, batch size (`examples`)
        and the fraction of examples clipping scaled down (`clipped`; non-private diagnostics)."""
        step = self.step
        torch.manual_seed(keyed_seed(self.seed, "step", step))  # dropout, CAPE, layer drop
        lr = step_decay_lr(self.schedule, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        chosen = sample_cohort(len(self.utterances), self.batch, "poisson", self.seed, step)
        stats = self.noised_gradient(chosen.tolist(), step)
        self.optimizer.original_optimizer.step()
        self.step += 1
        return {"step": step, "lr": lr, **stats}

    def noised_gradient(self, chosen: list[int], step: int) -> dict:
        """Leaves in every trained tensor's .grad opacus' privatized gradient of the examples
        `chosen`: (Σ_i clip(g_i) + N(0, z²C²)) / B, the noise drawn from step `step`'s stream."""
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        opt.generator = noise_generator(self.seed, step, device=self.device)
        augment = torch.Generator().manual_seed(keyed_seed(self.seed, "specaug", step))
        parts = list(chunks(chosen, self.physical_batch)) or [[]]  # an empty batch: noise only
        loss, clipped = 0.0, 0
        for i, part in enumerate(parts):
            if part:
                loss += self._backward(part, augment)
            else:
                for param in self.trained:
                    param.grad_sample = param.new_zeros((0, *param.shape))
            clipped += self._clipped(len(part))
            last = i == len(parts) - 1
            opt.signal_skip_step(do_skip=not last)
            opt.pre_step()  # clips and accumulates; the last part adds the noise and scales
            if not last:
                opt.zero_grad(set_to_none=True)  # per-example gradients; the sum is kept
        return {
            "loss": loss / len(chosen) if chosen else None,
            "examples": len(chosen),
            "clipped": clipped / len(chosen) if chosen else None,
        }

    def _backward(self, part: list[int], augment: torch.Generator) -> float:
        """Forward and backward of the examples `part` (each example's summed CTC loss), leaving
        each trained tensor's per-example gradients in .grad_sample; returns the summed loss."""
        items = [self.utterances[i] for i in part]
        batch = collate(items).to(self.device)
        feats = batch.feats
        if self.spec_augment.enabled:
            args = self.spec_augment.model_dump(exclude={"enabled"})
            feats = apply_spec_augment(feats, batch.feat_lens, augment, **args)
        with warnings.catch_warnings():
            # The conv's input needs no gradient, so its backward hook fires on outputs only.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            log_probs, out_lens = self.module(feats, batch.feat_lens)
            losses = ctc_losses(log_probs, out_lens, batch.targets, batch.target_lens)
            losses.sum().backward()
        for param in self.trained:
            if param.grad_sample is not None:
                # Under bf16 autocast (CUDA) opacus would measure the norms it clips by in bf16.
                param.grad_sample = param.grad_sample.to(param.dtype)
                continue
            if param.grad is not None:  # a gradient, but none per example: never left unclipped
                raise RuntimeError(
                    f"opacus computed no per-example gradient for a trained tensor of shape"
                    f" {tuple(param.shape)}"
                )
            # Its module did not run (layer drop): each example's gradient is zero.
            param.grad_sample = param.new_zeros((len(part), *param.shape))
        return float(losses.detach().sum())

    def _clipped(self, examples: int) -> int:
        """How many of the current per-example gradients clipping will scale down (global: the
        total norm over C; per layer: some tensor's norm over its C_h)."""
        if not examples:
            return 0
        norms = torch.stack(
            [p.grad_sample.reshape(examples, -1).norm(dim=1) for p in self.trained], dim=1
        ).double()
        if self.bounds is None:
            over = norms.norm(dim=1) > self.clip_bound
        else:
            over = (norms > self.bounds.to(norms.device)).any(dim=1)
        return int(over.sum())

    # ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Tensor]:
        return {**self.model.state_dict(), **optimizer_tensors(self.optimizer.original_optimizer)}

    def load_state_dict(self, tensors: dict[str, Tensor], step: int) -> None:
        self.model.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("optim.")})
        load_optimizer_tensors(self.optimizer.original_optimizer, tensors)
        self.step = step

    def finish(self) -> CTCTransformer:
        """The trained model without opacus' hooks and per-example gradient attributes."""
        return self.module.to_standard_module().eval()
