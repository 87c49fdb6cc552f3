"""`pflbench bench fl`: where the time and memory of a central step go.

Runs real central steps of the simulator (client training, clipping, exact sum, noise, server
LAMB step) on in-memory random utterances, so it needs no corpus, and prints:
- local-step time and, on CUDA, model-FLOPs utilization (MFU) of client training (bf16);
- time per central step and the fraction of it spent outside client forward/backward/update
  (copying the global model, deltas, clipping, summing, noise, all-reduce, server step, data);
- peak memory during a central step at cohort 8 and 64 (it must not grow with the cohort);
- on CUDA, the GPU-hours the paper's run (S = 1024, 10 local steps, T = 2000) would take at the
  measured per-client time;
- with --parallel-clients G, the same with G clients trained at once (fl.parallel) and its
  speed-up over one client at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pflbench.data.store import Utterance
from pflbench.fl.distributed import DistContext
from pflbench.fl.simulator import Simulator
from pflbench.model.transformer import build_model, count_parameters, model_flops_per_frame
from pflbench.spec.models import Recipe

VOCAB = 30
UTTERANCE_SECONDS = 5.0
TOKENS_PER_SECOND = 15
PAPER_COHORT, PAPER_STEPS = 1024, 2000


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
    preset: str, device: str, cohort: int, local_steps: int, parallel_clients: int = 1
) -> Simulator:
    batch_seconds = 120.0 if device.startswith("cuda") else 20.0
    recipe = bench_recipe(preset, cohort, local_steps, batch_seconds)
    torch.manual_seed(0)
    model = build_model(preset, VOCAB)
    per_user = max(2, int(batch_seconds // UTTERANCE_SECONDS) * 2)
    store = RandomUserStore(num_users=cohort, utterances_per_user=per_user)
    sim = Simulator(model, store, recipe, 1e-5, seed=0, device=device, ctx=DistContext(),
                    parallel_clients=parallel_clients)  # fmt: skip
    sim.client.synchronize = True
    return sim


def timed_steps(sim: Simulator, steps: int) -> tuple[float, float, dict]:
    """(wall seconds, client compute seconds, last stats) over `steps` central steps."""
    sim.client.compute_seconds = 0.0
    started = time.perf_counter()
    for _ in range(steps):
        stats = sim.run_step()
    if sim.device.startswith("cuda"):
        torch.cuda.synchronize(sim.device)
    return time.perf_counter() - started, sim.client.compute_seconds, stats


def step_peak_memory(preset: str, device: str, cohort: int) -> int | None:
    sim = make_simulator(preset, device, cohort, local_steps=1)
    sim.run_step()  # warm-up: allocator pools and lazily created buffers
    reset_peak_memory(device)
    sim.run_step()
    return peak_memory_bytes(device)


def bench_fl(
    preset: str, device: str, cohort: int = 8, local_steps: int = 10, parallel_clients: int = 1
) -> dict:
    """The figures of the module docstring; with parallel_clients > 1, of the simulator training
    that many clients at once, plus its speed-up over one client at a time."""
    from pflbench.evaluate import PEAK_BF16

    cuda = device.startswith("cuda")
    steps = 2
    sim = make_simulator(preset, device, cohort, local_steps, parallel_clients)  # refuses early
    one_at_a_time = None
    if parallel_clients > 1:
        sequential = make_simulator(preset, device, cohort, local_steps)
        timed_steps(sequential, 1)  # warm-up
        one_at_a_time = timed_steps(sequential, steps)[0] / steps
        del sequential
    timed_steps(sim, 1)  # warm-up
    wall, compute, stats = timed_steps(sim, steps)
    local_step_seconds = compute / max(1, steps * stats["local_steps"])
    figures: dict = {
        "preset": preset,
        "parameters": count_parameters(sim.model),
        "cohort": cohort,
        "local_steps": local_steps,
        "batch_seconds": sim.recipe.federated.client.batch_seconds,
        "local_step_seconds": local_step_seconds,
        "central_step_seconds": wall / steps,
        "outside_client_fraction": 1.0 - compute / wall,
        "parallel_clients": parallel_clients,
    }
    if one_at_a_time is not None:
        figures["central_step_seconds_one_client_at_a_time"] = one_at_a_time
        figures["parallel_speedup"] = one_at_a_time / (wall / steps)
    if cuda:
        cfg = sim.model.cfg
        out_frames = stats["frames"] / cfg.conv_stride
        frames_per_utt = UTTERANCE_SECONDS * 100 / cfg.conv_stride
        flops = model_flops_per_frame(cfg, VOCAB, int(frames_per_utt)) * out_frames * steps
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
        figures["device_name"] = name
        figures["mfu"] = flops / compute / peak if peak else None
        per_client = wall / steps / cohort
        figures["paper_run_gpu_hours_extrapolated"] = (
            per_client * PAPER_COHORT * PAPER_STEPS / 3600 * (10 / local_steps)
        )
        figures["paper_run_gpu_hours_reported"] = 1120.0
    del sim
    figures["peak_memory_bytes_cohort8"] = step_peak_memory(preset, device, 8)
    figures["peak_memory_bytes_cohort64"] = step_peak_memory(preset, device, 64)
    small, large = figures["peak_memory_bytes_cohort8"], figures["peak_memory_bytes_cohort64"]
    figures["peak_memory_ratio_64_vs_8"] = large / small if small and large else None
    return figures
