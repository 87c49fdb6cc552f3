"""World-size invariance: the same short run in 1 process and in 2 gloo processes (real
torch.distributed, spawned) ends with bitwise identical parameters."""

import os
import socket

import torch
import torch.multiprocessing as mp

from pflbench.fl.bench import RandomUserStore
from pflbench.fl.distributed import init_from_env, shutdown
from pflbench.fl.simulator import Simulator
from pflbench.model.transformer import build_model
from pflbench.spec.models import Recipe

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)  # the same kernels in every configuration
    ctx = init_from_env("cpu")
    torch.manual_seed(0)
    model = build_model("tiny", 30)
    store = RandomUserStore(num_users=12, utterances_per_user=4)
    sim = Simulator(model, store, RECIPE, sigma_dp=0.5, seed=3, device="cpu", ctx=ctx)
    losses = [sim.run_step()["loss"] for _ in range(3)]
    if rank == 0:
        torch.save({"params": dict(model.state_dict()), "losses": losses}, out)
    shutdown()


def _run(world_size: int, out: str) -> dict:
    mp.spawn(_worker, args=(world_size, _free_port(), out), nprocs=world_size, join=True)
    return torch.load(out)


def test_one_and_two_processes_give_bitwise_identical_models(tmp_path):
    one = _run(1, str(tmp_path / "one.pt"))
    two = _run(2, str(tmp_path / "two.pt"))
    assert one["params"].keys() == two["params"].keys()
    for name, value in one["params"].items():
        assert torch.equal(value, two["params"][name]), name
    torch.manual_seed(0)
    initial = build_model("tiny", 30).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in one["params"].items())
