"""`pflbench bench model`: training throughput of one model on random utterances.

Seconds of audio per second, and on CUDA the model-FLOPs utilization (MFU, bf16 autocast) at the
paper's 120 s client batch (60 s on CPU). FLOPs count only what runs: with layer drop p a training
forward runs (1 − p) of the blocks on average, and that is what MFU is computed from. On CPU it
also gives the process's CPU seconds per step (wall time is unusable on a shared machine), the
digest of the trained weights and the kernels torch ran (pflbench.numerics): two machines, or two
settings of ATEN_CPU_CAPABILITY / MKL_CBWR / ONEDNN_MAX_CPU_ISA, with the same digest computed
the same floats.
"""

from __future__ import annotations

import time

import torch

from pflbench.digests import state_digest
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


def bench_model(device: str = "cpu", preset: str = "synth-cpu", steps: int | None = None) -> dict:
    """One central-training step (forward, CTC, backward, optimizer) timed over `steps`."""
    from pflbench.model.optim import make_central_optimizer
    from pflbench.numerics import cpu_kernels
    from pflbench.spec.models import CentralRecipe

    cuda = device.startswith("cuda")
    batch_seconds, utt_seconds = (120.0 if cuda else 60.0), 5.0
    batch, frames_in = int(batch_seconds / utt_seconds), int(utt_seconds * 100)
    steps = steps or (10 if cuda else 4)
    torch.manual_seed(0)
    model = build_model(preset, vocab_size=30).to(device).train()
    opt = make_central_optimizer(model.named_parameters(), CentralRecipe())
    feats = torch.randn(batch, frames_in, 80, device=device)
    feat_lens = torch.full((batch,), frames_in, device=device)
    targets = torch.randint(1, 30, (batch, int(utt_seconds * 15)), device=device)
    target_lens = torch.full((batch,), targets.shape[1], device=device)

    def step() -> None:
        log_probs, out_lens = model(feats, feat_lens)
        ctc_loss(log_probs, out_lens, targets, target_lens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up: allocations, kernels
    sync()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    sync()
    step_seconds = (time.perf_counter() - t0) / steps
    cpu_step_seconds = (time.process_time() - cpu0) / steps
    frames_out = int(model.output_lengths(feat_lens[:1]).item())
    per_frame = model_flops_per_frame(model.cfg, 30, frames_out, training_layers(model.cfg))
    flops = per_frame * frames_out * batch / step_seconds
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
        peak = peak_bf16(torch.cuda.get_device_name())
        out["mfu"] = flops / peak if peak else None
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        kernels = cpu_kernels()
        out["cpu_seconds_per_step"] = cpu_step_seconds
        out["weights_digest"] = state_digest(model.state_dict())[:16]
        names = ("aten_capability", "mkl_cbwr", "onednn_enabled", "onednn_max_cpu_isa")
        out["kernels"] = {name: kernels[name] for name in names}
    return out
