"""Example-level DP-SGD (paper 003) with opacus: the seed model fine-tuned on the pooled federated
training data, each example's gradient clipped and the sum noised.

    per step t:  batch = Poisson sample of the N examples at q = B/N    (privacy.sampling)
                 g_i   = per-example gradients                           (GradSampleModule)
                 ĝ     = (Σ_i clip_C(g_i) + N(0, z²C²)) / B              (opacus DPOptimizer)
                 θ    ← the fine_tune optimizer's step with ĝ, at fine_tune's lr schedule

Clipping is pflbench's, exact (privacy.example_optimizer: opacus' DPOptimizer with its clipping
replaced): global (‖g_i‖ ≤ C) or per tensor (‖g_i,h‖ ≤ C_h with pflbench's per-layer allocation,
privacy.clipping.layer_bounds, over the trained tensors), each bound holding for every example's
scaled gradient as stored in fp32, not only up to rounding; an example whose gradient holds a
NaN/Inf is zeroed and counted. Opacus' hook-based grad samplers cover every parameter of the CTC
transformer (Linear, Conv1d, LayerNorm; attention is parameter-free); a module without one would
get opacus' functorch sampler. Every trained tensor must get a per-example gradient: a tensor
that has a gradient but none per example is an error, never left out of the clipping; a tensor
whose module did not run (layer drop) has a zero gradient for every example. Frozen tensors (layer
freezing) are not trained, clipped or noised.

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
from pflbench.privacy.noise import noise_generator
from pflbench.privacy.sampling import sample_cohort
from pflbench.seeds import keyed_seed, seed_global_draws
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

        from pflbench.privacy.example_optimizer import ExactClipDPOptimizer

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
        self.optimizer = ExactClipDPOptimizer(
            inner,
            clipping=privacy.clipping,
            clip_bound=privacy.clip_bound,
            perlayer_mode=privacy.perlayer_mode,
            noise_multiplier=noise_multiplier,
            expected_batch_size=batch,
            max_examples=len(utterances),
            loss_reduction="mean",  # the noised sum divided by B
        )

    # ------------------------------------------------------------------------------------------

    def run_step(self) -> dict:
        """One DP-SGD step; returns its loss (mean over the batch), lr, batch size (`examples`),
        the fraction of examples clipping scaled down (`clipped`; a non-private diagnostic) and
        how many examples were zeroed for a NaN/Inf gradient (`nonfinite`)."""
        step = self.step
        # dropout, CAPE, layer drop
        seed_global_draws(keyed_seed(self.seed, "step", step), self.device)
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
        loss, clipped, nonfinite = 0.0, 0, 0
        for i, part in enumerate(parts):
            if part:
                loss += self._backward(part, augment)
            else:
                for param in self.trained:
                    param.grad_sample = param.new_zeros((0, *param.shape))
            last = i == len(parts) - 1
            opt.signal_skip_step(do_skip=not last)
            opt.pre_step()  # clips and accumulates; the last part adds the noise and scales
            clipped += opt.last_clip.clipped
            nonfinite += int(opt.last_clip.nonfinite.sum())
            if not last:
                opt.zero_grad(set_to_none=True)  # per-example gradients; the sum is kept
        return {
            "loss": loss / len(chosen) if chosen else None,
            "examples": len(chosen),
            "clipped": clipped / len(chosen) if chosen else None,
            "nonfinite": nonfinite,
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
                continue
            if param.grad is not None:  # a gradient, but none per example: never left unclipped
                raise RuntimeError(
                    f"opacus computed no per-example gradient for a trained tensor of shape"
                    f" {tuple(param.shape)}"
                )
            # Its module did not run (layer drop): each example's gradient is zero.
            param.grad_sample = param.new_zeros((len(part), *param.shape))
        return float(losses.detach().sum())

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
