"""World-size invariance: the same short run in 1 process and in 2 gloo processes (real
torch.distributed, spawned) ends with bitwise identical parameters. The process group a run
initializes has a backend for every tensor a step all-reduces (CPU stats, device sums)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, make_mechanism
from torch.distributed.distributed_c10d import Backend, BackendConfig

from pflbench.data.store import torch_threads
from pflbench.fl.aggregate import StepAggregator
from pflbench.fl.bench import RandomUserStore
from pflbench.fl.distributed import (
    DistContext,
    init_from_env,
    join_process_group,
    process_group_backend,
    shutdown,
)
from pflbench.fl.simulator import Simulator
from pflbench.model.transformer import build_model
from pflbench.spec.models import PrivacyRecipe, Recipe

RECIPE = Recipe.model_validate(
    {
        "federated": {
            "cohort_size": 5,
            "client": {"local_steps": 2, "batch_seconds": 10.0},
            "server": {"lr": 0.01},
        },
        "privacy": {"clipping": "perlayer", "perlayer_mode": "dim", "clip_bound": 0.01},
    }
)


def _three_steps(ctx: DistContext) -> dict:
    torch.manual_seed(0)
    model = build_model("tiny", 30)
    store = RandomUserStore(num_users=12, utterances_per_user=4)
    sim = Simulator(model, store, RECIPE, sigma_dp=0.5, seed=3, device="cpu", ctx=ctx)
    losses = [sim.run_step()["loss"] for _ in range(3)]
    return {"params": dict(model.state_dict()), "losses": losses}


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)  # the same kernels in every configuration
    result = _three_steps(init_from_env("cpu"))
    if rank == 0:
        torch.save(result, out)
    shutdown()


@pytest.mark.slow
def test_one_and_two_processes_give_bitwise_identical_models(tmp_path):
    with torch_threads(1):  # one process: this one
        one = _three_steps(init_from_env("cpu"))
    out = str(tmp_path / "two.pt")
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2, join=True)
    two = torch.load(out)
    assert one["params"].keys() == two["params"].keys()
    for name, value in one["params"].items():
        assert torch.equal(value, two["params"][name]), name
    torch.manual_seed(0)
    initial = build_model("tiny", 30).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in one["params"].items())


# ----------------------------------------------------------------------------------------------
# Backends: every tensor a step all-reduces goes to a backend that takes its device


def device_backends(backend: str) -> dict[str, str]:
    return BackendConfig(Backend(backend)).get_device_backend_map()


def test_a_cuda_run_has_a_backend_for_every_tensor_its_steps_all_reduce():
    # A CUDA run's step reduces its int64 sums on the GPU and its float64 stats on the CPU; an
    # NCCL-only group has no backend for the CPU tensor and fails at the first step.
    agg = StepAggregator({"w": torch.zeros(3)}, make_mechanism(PrivacyRecipe(), 2), 0, 1.0)
    for stats in (agg.norm_sums, agg.norm_squares):  # with the counters, one CPU stats tensor
        assert stats.device.type == "cpu" and stats.dtype == torch.float64
    assert device_backends(process_group_backend("cuda")) == {"cpu": "gloo", "cuda": "nccl"}
    assert device_backends(process_group_backend("cpu"))["cpu"] == "gloo"
    assert "cpu" not in device_backends("nccl")  # what a CUDA run used to initialize


def _stats_worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # fmt: skip
    init_from_env("cpu")
    backends = device_backends(dist.get_backend_config())
    handed, real_all_reduce = [], dist.all_reduce

    def checked_all_reduce(tensor, *args, **kwargs):  # the real collective, after a check
        handed.append(tensor.device.type)
        assert tensor.device.type in backends, (tensor.device, backends)
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = checked_all_reduce
    privacy = PrivacyRecipe(clipping="global", clip_bound=1.0)
    agg = StepAggregator({"w": torch.zeros(2)}, make_mechanism(privacy, 3), 0, 10.0)
    # rank 0 holds user a, rank 1 users b and c (b over the bound C = 1: clipped to [0.6, 0.8])
    users = {
        0: [("a", [0.3, 0.0], 1.0, 100)],
        1: [("b", [3.0, 4.0], 2.0, 10), ("c", [0.0, 0.2], 6.0, 1)],
    }
    for user, values, loss, frames in users[rank]:
        agg.add({"w": torch.tensor(values)}, user, loss, 2, frames)
    grads, stats = agg.finish()
    if rank == 0:
        torch.save({"grads": grads, "stats": stats, "handed": handed}, out)
    shutdown()


@pytest.mark.slow
def test_step_stats_all_reduce_over_gloo_in_real_processes(tmp_path):
    out = str(tmp_path / "stats.pt")
    mp.spawn(_stats_worker, args=(2, free_port(), out), nprocs=2, join=True)
    result = torch.load(out)
    stats = result["stats"]
    assert (stats["clients"], stats["local_steps"], stats["frames"]) == (3, 6, 111)
    assert stats["loss"] == 3.0 and stats["diagnostics"]["clipped_fraction"] == 1 / 3
    assert stats["diagnostics"]["layer_norm_mean"]["w"] == pytest.approx((0.3 + 5 + 0.2) / 3)
    torch.testing.assert_close(result["grads"][0], torch.tensor([0.9, 1.0]) / 3)
    assert result["handed"] == ["cpu", "cpu"]  # the int64 sums, then the float64 stats


def _cuda_worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    join_process_group("cuda", rank)  # what init_from_env does for a CUDA run (for any world)
    ctx = DistContext(rank=rank, world_size=world_size, local_rank=rank)
    torch.manual_seed(0)
    model = build_model("tiny", 30)
    store = RandomUserStore(num_users=12, utterances_per_user=4)
    sim = Simulator(model, store, RECIPE, sigma_dp=0.5, seed=3, device=f"cuda:{rank}", ctx=ctx)
    stats = [sim.run_step() for _ in range(2)]
    if rank == 0:
        torch.save({"stats": stats, "backend": dist.get_backend_config()}, out)
    shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_process_group_runs_real_steps(tmp_path):
    """The group exactly as a CUDA run initializes it (one process per GPU, at most two), and
    two federated steps whose CPU stats and GPU sums are all-reduced over it."""
    world_size = min(2, torch.cuda.device_count())
    out = str(tmp_path / "cuda.pt")
    mp.spawn(_cuda_worker, args=(world_size, free_port(), out), nprocs=world_size, join=True)
    result = torch.load(out)
    assert device_backends(result["backend"]) == {"cpu": "gloo", "cuda": "nccl"}
    for step in result["stats"]:
        assert step["clients"] > 0 and step["diagnostics"]["update_norm_after_noise"] > 0
