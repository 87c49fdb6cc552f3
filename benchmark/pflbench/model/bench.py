"""`pflbench bench model`: training throughput of one model on random utterances.

Seconds of audio per second, and on CUDA the model-FLOPs utilization (MFU, bf16 autocast) at the
paper's 120 s client batch (60 s on CPU). FLOPs count only what runs: with layer drop p a training
forward runs (1 − p) of the blocks on average, and that is what MFU is computed from. On CPU it
also gives the process's CPU seconds per step (wall time is unusable on a shared machine), the
digest of the trained weights and the kernels torch ran (pflbench.numerics): two machines, or two
settings of ATEN_CPU_CAPABILITY / MKL_CBWR / ONEDNN_MAX_CPU_ISA, with the same digest computed
the same floats. With a compile backend (`--compile`: inductor), the same steps again with
torch.compile on the loss (forward and CTC, the backward compiled with it; CUDA graphs on CUDA)
and on the optimizer step (without CUDA graphs, as fl.client's update): their times, the first
step's (compilation included) and the speed-up over eager; the two take their steps in turn, so
that a shared machine's load weighs on both alike.
"""

from __future__ import annotations

import time

import torch

from pflbench.digests import state_digest
from pflbench.model.compiling import step_compiler, uses_cuda_graphs
from pflbench.model.transformer import (
    build_model,
    count_parameters,
    ctc_loss,
    model_flops_per_frame,
    training_layers,
)

# Dense bf16 peak FLOP/s by GPU name (datasheet, SXM parts), for model-FLOPs utilization.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def peak_bf16(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def device_label(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


class Training:
    """One model trained on one random batch, step by step, on its own stream of the global RNG
    (CAPE's draws): trainings can take turns, each training as it would alone."""

    def __init__(self, device: str, preset: str, batch_seconds: float, compile_backend: str | None):
        from pflbench.model.optim import make_central_optimizer
        from pflbench.spec.models import CentralRecipe

        self.device, cuda = device, device.startswith("cuda")
        utt_seconds = 5.0
        batch, frames_in = int(batch_seconds / utt_seconds), int(utt_seconds * 100)
        with torch.random.fork_rng(devices=[device] if cuda else []):
            torch.manual_seed(0)
            self.model = build_model(preset, vocab_size=30).to(device).train()
            self.opt = make_central_optimizer(self.model.named_parameters(), CentralRecipe())
            self.feats = torch.randn(batch, frames_in, 80, device=device)
            self.feat_lens = torch.full((batch,), frames_in, device=device)
            self.targets = torch.randint(1, 30, (batch, int(utt_seconds * 15)), device=device)
            self.target_lens = torch.full((batch,), self.targets.shape[1], device=device)
            self.rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None
        self.loss, self.optimizer_step = self._loss, self.opt.step
        self.cuda_graphs = uses_cuda_graphs(compile_backend, device)
        if compile_backend is not None:  # the optimizer step without CUDA graphs (fl.client)
            self.loss = step_compiler(compile_backend, self.cuda_graphs)(self._loss)
            self.optimizer_step = step_compiler(compile_backend)(self.opt.step)

    def _loss(self) -> torch.Tensor:
        log_probs, out_lens = self.model(self.feats, self.feat_lens)
        return ctc_loss(log_probs, out_lens, self.targets, self.target_lens)

    def step(self) -> tuple[float, float]:
        """One step: (wall seconds, CPU seconds of this process)."""
        cuda = self.device.startswith("cuda")
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            torch.set_rng_state(self.rng[0])
            if cuda:
                torch.cuda.set_rng_state(self.rng[1], self.device)
            wall, cpu = time.perf_counter(), time.process_time()
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            self.loss().backward()
            self.optimizer_step()
            self.opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            self.rng = (
                torch.get_rng_state(),
                torch.cuda.get_rng_state(self.device) if cuda else None,
            )
        return wall, cpu


def bench_model(
    device: str = "cpu",
    preset: str = "synth-cpu",
    steps: int | None = None,
    compile_backend: str | None = None,
) -> dict:
    """One central-training step (forward, CTC, backward, optimizer) timed over `steps`; with a
    `compile_backend`, compiled too (module docstring)."""
    from pflbench.numerics import cpu_kernels

    cuda = device.startswith("cuda")
    batch_seconds, utt_seconds = (120.0 if cuda else 60.0), 5.0
    batch, frames_in = int(batch_seconds / utt_seconds), int(utt_seconds * 100)
    steps = steps or (10 if cuda else 4)
    trainings = {"eager": Training(device, preset, batch_seconds, None)}
    if compile_backend is not None:
        trainings["compiled"] = Training(device, preset, batch_seconds, compile_backend)
    # A warm-up step each (allocations, kernels, compilation), then steps in turn, so that the
    # load of a shared machine weighs on both alike.
    first = {name: training.step()[0] for name, training in trainings.items()}
    times = {name: [0.0, 0.0] for name in trainings}
    for _ in range(steps):
        for name, training in trainings.items():
            for i, seconds in enumerate(training.step()):
                times[name][i] += seconds
    model = trainings["eager"].model
    step_seconds, cpu_step_seconds = (t / steps for t in times["eager"])
    feat_lens = torch.full((1,), frames_in)
    frames_out = int(model.output_lengths(feat_lens).item())
    per_frame = model_flops_per_frame(model.cfg, 30, frames_out, training_layers(model.cfg))
    flops_per_step = per_frame * frames_out * batch
    flops = flops_per_step / step_seconds
    peak = peak_bf16(torch.cuda.get_device_name()) if cuda else None
    out = {
        "preset": preset,
        "device": device_label(device),
        "parameters_m": count_parameters(model) / 1e6,
        "dropout": model.cfg.dropout,
        "layer_drop": model.cfg.layer_drop,
        "batch_seconds_of_audio": batch_seconds,
        "step_seconds": step_seconds,
        "audio_seconds_per_second": batch_seconds / step_seconds,
        "model_tflops_per_second": flops / 1e12,
    }
    if cuda:
        out["mfu"] = flops / peak if peak else None
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        kernels = cpu_kernels()
        out["cpu_seconds_per_step"] = cpu_step_seconds
        out["weights_digest"] = state_digest(model.state_dict())[:16]
        names = ("aten_capability", "mkl_cbwr", "onednn_enabled", "onednn_max_cpu_isa")
        out["kernels"] = {name: kernels[name] for name in names}
    out["first_step_seconds"] = first["eager"]
    if compile_backend is not None:
        seconds = times["compiled"][0] / steps
        compiled = {
            "backend": compile_backend,
            "step_seconds": seconds,
            "first_step_seconds": first["compiled"],
            "model_tflops_per_second": flops_per_step / seconds / 1e12,
        }
        if cuda:
            compiled["mfu"] = flops_per_step / seconds / peak if peak else None
        else:  # compiled kernels round differently: a digest of their own
            compiled["cpu_seconds_per_step"] = times["compiled"][1] / steps
            compiled_model = trainings["compiled"].model
            compiled["weights_digest"] = state_digest(compiled_model.state_dict())[:16]
        out["compiled"] = compiled
        out["compile_speedup"] = step_seconds / seconds
    return out
