"""`pflbench bench fl`: where the time and memory of a central step go.

Runs real central steps of the simulator (client training, clipping, exact sum, noise, server
LAMB step) on in-memory random utterances, so it needs no corpus, and prints:
- local-step time and, on CUDA, model-FLOPs utilization (MFU) of client training (bf16);
- time per central step and the fraction of it spent outside client forward/backward/update
  (copying the global model, deltas, clipping, summing, noise, all-reduce, server step, data);
- the fraction of it in per-user aggregation alone (the privacy steps and the exact sum), and
  on a CPU whether the privacy path's C kernels ran it (privacy/_kernels.c);
- peak memory during a central step at cohort 8 and 64 (it must not grow with the cohort);
- on CUDA, the GPU-hours the paper's run (S = 1024, 10 local steps, T = 2000) would take at the
  measured time per client, and the A100-hours that is worth at the dense-bf16 peak ratio of the
  two GPUs (the paper reports 1,120 A100-hours);
- with --parallel-clients G, the same with G clients trained at once (fl.parallel) and its
  speed-up over one client at a time;
- with --compile, the same with the local step compiled (fl.client; inductor, the loss under
  CUDA graphs on CUDA), its speed-up over the eager step, and the first central step's time
  (compilation included) of both.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pflbench.data.store import Utterance
from pflbench.fl.distributed import DistContext
from pflbench.fl.simulator import Simulator
from pflbench.model.bench import PEAK_BF16, peak_bf16
from pflbench.model.transformer import (
    build_model,
    count_parameters,
    model_flops_per_frame,
    training_layers,
)
from pflbench.privacy.aggregate import adds_in_one_pass
from pflbench.privacy.clipping import kernel_norms_are_torchs
from pflbench.spec.models import Recipe

VOCAB = 30
UTTERANCE_SECONDS = 5.0
TOKENS_PER_SECOND = 15
PAPER_COHORT, PAPER_STEPS, PAPER_LOCAL_STEPS = 1024, 2000, 10
PAPER_A100_HOURS = 1120.0  # 002 Table 22: LS-100 -> CV-en, FL + DP, 32 A100 x 35 h


@dataclass
class RandomUserStore:
    """Users of random 5 s utterances, with the FeatureStore interface the simulator reads."""

    num_users: int
    utterances_per_user: int

    def users(self) -> list[str]:
        return [f"user{i:05d}" for i in range(self.num_users)]

    def user_seconds(self, user: str) -> float:
        return self.utterances_per_user * UTTERANCE_SECONDS

    def user_num_utterances(self, user: str) -> int:
        return self.utterances_per_user

    def load_user(self, user: str) -> list[Utterance]:
        generator = torch.Generator().manual_seed(int(user.removeprefix("user")))
        frames, length = int(UTTERANCE_SECONDS * 100), int(UTTERANCE_SECONDS * TOKENS_PER_SECOND)
        return [
            Utterance(
                utt_id=f"{user}-{i}",
                user_id=user,
                feats=torch.randn(frames, 80, generator=generator),
                tokens=torch.randint(1, VOCAB, (length,), generator=generator),
                text="",
                seconds=UTTERANCE_SECONDS,
            )
            for i in range(self.utterances_per_user)
        ]


def bench_recipe(preset: str, cohort: int, local_steps: int, batch_seconds: float) -> Recipe:
    return Recipe.model_validate(
        {
            "model": {"preset": preset},
            "federated": {
                "cohort_size": cohort,
                "sampling": "fixed",
                "client": {"local_steps": local_steps, "batch_seconds": batch_seconds},
            },
            "privacy": {"clipping": "perlayer", "perlayer_mode": "dim"},
        }
    )


def reset_peak_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    elif Path("/proc/self/clear_refs").exists():
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM (peak RSS)


def peak_memory_bytes(device: str) -> int | None:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def make_simulator(
    preset: str,
    device: str,
    cohort: int,
    local_steps: int,
    parallel_clients: int = 1,
    dropout: float | None = None,
    layer_drop: float | None = None,
    compile_backend: str | None = None,
) -> Simulator:
    batch_seconds = 120.0 if device.startswith("cuda") else 20.0
    recipe = bench_recipe(preset, cohort, local_steps, batch_seconds)
    torch.manual_seed(0)
    model = build_model(preset, VOCAB, dropout=dropout, layer_drop=layer_drop)
    per_user = max(2, int(batch_seconds // UTTERANCE_SECONDS) * 2)
    store = RandomUserStore(num_users=cohort, utterances_per_user=per_user)
    sim = Simulator(model, store, recipe, 1e-5, seed=0, device=device, ctx=DistContext(),
                    parallel_clients=parallel_clients, compile_backend=compile_backend)  # fmt: skip
    sim.client.synchronize = True
    return sim


def timed_steps(sim: Simulator, steps: int) -> tuple[float, float, dict]:
    """(wall seconds, client compute seconds, last stats) over `steps` central steps."""
    sim.client.compute_seconds = sim.aggregation_seconds = 0.0
    started = time.perf_counter()
    for _ in range(steps):
        stats = sim.run_step()
    if sim.device.startswith("cuda"):
        torch.cuda.synchronize(sim.device)
    return time.perf_counter() - started, sim.client.compute_seconds, stats


def step_peak_memory(preset: str, device: str, cohort: int, **sim_args) -> int | None:
    # The simulators measured before (reference cycles) would otherwise count as this one's:
    # on an H200 the peak at cohort 8 came out above cohort 64's.
    gc.collect()
    sim = make_simulator(preset, device, cohort, local_steps=1, **sim_args)
    sim.run_step()  # warm-up: allocator pools and lazily created buffers
    reset_peak_memory(device)
    sim.run_step()
    return peak_memory_bytes(device)


def bench_fl(
    preset: str,
    device: str,
    cohort: int = 8,
    local_steps: int = 10,
    parallel_clients: int = 1,
    dropout: float | None = None,
    layer_drop: float | None = None,
    compile_backend: str | None = None,
    report: Callable[[str], None] = lambda line: None,
) -> dict:
    """The figures of the module docstring; with parallel_clients > 1, of the simulator training
    that many clients at once, plus its speed-up over one client at a time (eager); with a
    `compile_backend` (`--compile`: inductor), of the local step compiled with it, plus its
    speed-up over the eager one (same G). `dropout` and `layer_drop` override the preset's
    (None: keep them). `report` gets a line as each phase ends, so that a run stopped part-way
    (a lent GPU's few minutes) still tells where its time went."""
    cuda = device.startswith("cuda")
    steps = 2
    model_args = {"dropout": dropout, "layer_drop": layer_drop}

    # The measured simulator, and those it is compared with: one client at a time (eager), and
    # the same G eager. A warm-up step each (compilation included), then central steps in turn,
    # so that the load of a shared machine weighs on all alike.
    setups = {"run": (parallel_clients, compile_backend)}
    if parallel_clients > 1:
        setups["one_at_a_time"] = (1, None)
    if compile_backend is not None:
        setups["eager"] = (parallel_clients, None)
    sims = {
        name: make_simulator(preset, device, cohort, local_steps, parallel, **model_args,
                             compile_backend=backend)
        for name, (parallel, backend) in setups.items()
    }  # fmt: skip
    first = {}
    for name, sim in sims.items():
        first[name] = timed_steps(sim, 1)[0]
        report(f"{name}: first central step {first[name]:.1f} s (compilation included)")
    totals = {name: [0.0, 0.0, 0.0] for name in sims}  # wall, client compute, aggregation
    local_steps_taken, frames = dict.fromkeys(sims, 0), dict.fromkeys(sims, 0)
    for _ in range(steps):
        for name, sim in sims.items():
            wall, compute, stats = timed_steps(sim, 1)
            totals[name][0] += wall
            totals[name][1] += compute
            totals[name][2] += sim.aggregation_seconds
            local_steps_taken[name] += stats["local_steps"]
            frames[name] += stats["frames"]
            report(f"{name}: central step {wall:.2f} s, client compute {compute:.2f} s")
    local_step = {name: totals[name][1] / max(1, local_steps_taken[name]) for name in sims}
    sim, (wall, compute, aggregation) = sims["run"], totals["run"]
    local_step_seconds = local_step["run"]
    # Which of the privacy path's C kernels ran the fp32 updates (on CUDA none: torch's code).
    kernels = {"exact_sum": adds_in_one_pass(), "fp64_norms": kernel_norms_are_torchs()}
    cpu_kernels = None if cuda else kernels
    figures: dict = {
        "preset": preset,
        "parameters": count_parameters(sim.model),
        "dropout": sim.model.cfg.dropout,
        "layer_drop": sim.model.cfg.layer_drop,
        "cohort": cohort,
        "local_steps": local_steps,
        "batch_seconds": sim.recipe.federated.client.batch_seconds,
        "local_step_seconds": local_step_seconds,
        "central_step_seconds": wall / steps,
        "outside_client_fraction": 1.0 - compute / wall,
        # Per-user privacy steps and the exact sum, apart (the target: <= 3%).
        "aggregation_fraction": aggregation / wall,
        "cpu_kernels": cpu_kernels,
        "parallel_clients": parallel_clients,
        "compile_backend": compile_backend,
        "first_central_step_seconds": first["run"],  # compilation included
    }
    if "one_at_a_time" in sims:
        one_at_a_time = totals["one_at_a_time"][0] / steps
        figures["central_step_seconds_one_client_at_a_time"] = one_at_a_time
        figures["parallel_speedup"] = one_at_a_time / (wall / steps)
    if "eager" in sims:
        figures["local_step_seconds_eager"] = local_step["eager"]
        figures["central_step_seconds_eager"] = totals["eager"][0] / steps
        figures["first_central_step_seconds_eager"] = first["eager"]
        figures["compile_speedup"] = totals["eager"][0] / wall
    if cuda:
        cfg = sim.model.cfg
        out_frames = frames["run"] / cfg.conv_stride
        frames_per_utt = int(UTTERANCE_SECONDS * 100 / cfg.conv_stride)
        per_frame = model_flops_per_frame(cfg, VOCAB, frames_per_utt, training_layers(cfg))
        flops = per_frame * out_frames
        name = torch.cuda.get_device_name(device)
        peak = peak_bf16(name)
        figures["device_name"] = name
        figures["mfu"] = flops / compute / peak if peak else None
        # The paper's run at this measured time per client (the whole central step, overhead
        # included, per client and local step).
        per_client_step = wall / steps / cohort / local_steps
        hours = per_client_step * PAPER_LOCAL_STEPS * PAPER_COHORT * PAPER_STEPS / 3600
        factor = peak / PEAK_BF16["A100"] if peak else None
        figures["paper_run_gpu_hours_extrapolated"] = hours
        figures["a100_per_gpu_factor_assumed"] = factor
        figures["paper_run_a100_hours_equivalent"] = hours * factor if factor else None
        figures["paper_run_a100_hours_reported"] = PAPER_A100_HOURS
    report(f"timing figures: {figures}")
    del sim, sims
    sim_args = {**model_args, "compile_backend": compile_backend}
    for memory_cohort in (8, 64):
        peak_bytes = step_peak_memory(preset, device, memory_cohort, **sim_args)
        figures[f"peak_memory_bytes_cohort{memory_cohort}"] = peak_bytes
        report(f"peak memory at cohort {memory_cohort}: {peak_bytes} bytes")
    small, large = figures["peak_memory_bytes_cohort8"], figures["peak_memory_bytes_cohort64"]
    figures["peak_memory_ratio_64_vs_8"] = large / small if small and large else None
    return figures
