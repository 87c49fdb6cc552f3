"""Seed training on 2 gloo processes (real torch.distributed, spawned): the same batches give the
one-process model up to float summation order, and a 2-process run stopped after a checkpoint and
resumed in new processes ends bitwise equal to the uninterrupted one."""

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port
from test_central import AUGMENT, RECIPE, tone_store

from pflbench.central import CentralCheckpoints, batch_shares, train_central
from pflbench.data.store import FeatureStore, torch_threads
from pflbench.data.text import tokenizer_for
from pflbench.errors import UserError
from pflbench.fl.distributed import DistContext, init_from_env, shutdown
from pflbench.model import build_model

# Batches of 2-5 tone utterances, so both ranks train on a share of most of them. SGD, not the
# tone tests' Adam: Adam scales gradients that are pure float noise (attention key biases, whose
# true gradient is 0) up to ±lr, so its steps are not stable under another summation order.
TWO_RANK_RECIPE = RECIPE.model_copy(update={"optimizer": "sgd", "lr": 0.05, "batch_seconds": 1.5})


def _train(store_path: str, steps: int, resume_dir: str | None, ctx) -> tuple[dict, dict]:
    torch.manual_seed(0 if resume_dir is None or not os.listdir(resume_dir) else 1000 + steps)
    model = build_model("tiny", vocab_size=tokenizer_for("en").size)
    stats = train_central(
        model,
        FeatureStore(store_path),
        TWO_RANK_RECIPE.model_copy(update={"steps": steps}),
        AUGMENT,
        device="cpu",
        seed=3,
        progress=False,
        checkpoints=CentralCheckpoints(resume_dir) if resume_dir else None,
        ctx=ctx,
    )
    return model.state_dict(), stats


def _worker(rank: int, port: int, store_path: str, runs: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    ctx = init_from_env("cpu")
    for i, (steps, resume_dir) in enumerate(runs):
        params, stats = _train(store_path, steps, resume_dir, ctx)
        torch.save({"params": params, "stats": stats}, f"{out}.{i}.{rank}")
    shutdown()


def _two_processes(store_path, out, *runs: tuple[int, Path | None]) -> list[dict]:
    """Each run (steps, resume folder or None) one after the other in 2 spawned processes (one
    process group: spawning them is what costs); rank 0's result of each."""
    runs_args = [(steps, resume_dir and str(resume_dir)) for steps, resume_dir in runs]
    mp.spawn(_worker, args=(free_port(), str(store_path), runs_args, str(out)), nprocs=2, join=True)
    results = []
    for i in range(len(runs)):
        ranks = [torch.load(f"{out}.{i}.{rank}") for rank in range(2)]
        for name, value in ranks[0]["params"].items():  # the ranks hold one model
            assert torch.equal(value, ranks[1]["params"][name]), name
        results.append(ranks[0])
    return results


def test_batch_shares_deal_lengths_round_robin():
    assert batch_shares([5, 9, 1, 7, 3], 2) == [[0, 1, 2], [3, 4]]  # 9, 5, 1 | 7, 3
    assert batch_shares([4], 2) == [[0], []]
    assert batch_shares([4, 2], 1) == [[0, 1]]


@pytest.mark.slow
def test_two_processes_train_the_one_process_seed_model_and_resume_exactly(tmp_path):
    store = tone_store(tmp_path / "store")
    with torch_threads(1):
        one, one_stats = _train(str(store.path), 4, None, init_from_env("cpu"))
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    # the uninterrupted run, and one stopped after its checkpoint at step 2 ...
    two, first = _two_processes(store.path, tmp_path / "two", (4, None), (2, resume_dir))
    # float32 sums in another order (each rank's loss sum, then the all-reduce) through 4 steps:
    # measured differences ≤ 6e-8 (one ulp at 1.0); the tolerance is 1e-6 absolute + 1e-5 relative
    for name, value in one.items():
        torch.testing.assert_close(two["params"][name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert (
        abs(two["stats"]["final_loss"] - one_stats["final_loss"]) <= 1e-5 * one_stats["final_loss"]
    )
    torch.manual_seed(0)
    initial = build_model("tiny", vocab_size=tokenizer_for("en").size).state_dict()
    assert any((initial[k] - v).abs().max() > 1e-3 for k, v in one.items())

    # ... resumed in new processes
    (resumed,) = _two_processes(store.path, tmp_path / "resumed", (4, resume_dir))
    assert first["stats"]["steps_this_run"] == 2 and resumed["stats"]["steps_this_run"] == 2
    for name, value in two["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert resumed["stats"]["layer_grad_sq_sums"] == two["stats"]["layer_grad_sq_sums"]


def test_multi_process_seed_training_refuses_dropout_and_other_process_counts(tmp_path):
    """Checked before any collective, so no process group is needed."""
    store = tone_store(tmp_path / "store")
    vocab = tokenizer_for("en").size
    two = DistContext(rank=0, world_size=2)
    kwargs = dict(device="cpu", seed=3, progress=False)
    with pytest.raises(UserError, match="dropout and layer_drop 0"):
        train_central(
            build_model("tiny", vocab, dropout=0.1), store, RECIPE, AUGMENT, **kwargs, ctx=two
        )
    one_step = RECIPE.model_copy(update={"steps": 1})
    train_central(
        build_model("tiny", vocab),
        store,
        one_step,
        AUGMENT,
        **kwargs,
        checkpoints=CentralCheckpoints(tmp_path),
    )
    with pytest.raises(UserError, match="1-process training; resume it with 1 processes, not 2"):
        train_central(
            build_model("tiny", vocab),
            store,
            RECIPE,
            AUGMENT,
            **kwargs,
            checkpoints=CentralCheckpoints(tmp_path),
            ctx=two,
        )
