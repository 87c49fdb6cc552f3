"""The CUDA paths: bf16 autocast inside the multi-client vmap, CUDA generators, a whole run.

Skipped where torch sees no GPU (CI); on a GPU machine: `python -m pytest tests/test_cuda.py`.
"""

import pytest
import torch
from conftest import make_algorithm
from test_run import TASK, _config, env, specs_dir  # noqa: F401  (fixtures)

from pflbench.fl.client import SequentialClientTrainer
from pflbench.fl.distributed import DistContext
from pflbench.fl.parallel import ParallelClientTrainer
from pflbench.fl.simulator import Simulator
from pflbench.model.transformer import build_model
from pflbench.results.schema import load_record
from pflbench.runner import RunOptions, run
from pflbench.spec.models import ClientRecipe, Recipe, SpecAugmentRecipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
AUGMENT = SpecAugmentRecipe(freq_masks=1, freq_width=8, time_masks=1, time_width=10)


def _clients_on_cuda(data, count: int):
    """The tiny model, its parameter names, a client algorithm (3 local steps of lr 0.5), the
    global weights on the GPU and the `count` largest clients with their utterances."""
    torch.manual_seed(0)
    model = build_model("tiny", data.tokenizer.size)
    recipe = ClientRecipe(batch_seconds=6.0, lr=0.5, local_steps=3)
    names = [n for n, _ in model.named_parameters()]
    global_params = [p.detach().cuda() for p in model.parameters()]
    store = data.federated_train
    users = sorted(store.users(), key=lambda u: (-store.user_num_utterances(u), u))[:count]
    clients = [(u, store.load_user(u)) for u in users]
    algorithm = make_algorithm(recipe, model, names, seed=7, device="cuda")
    return model, names, algorithm, global_params, clients


def test_group_updates_equal_one_client_at_a_time_on_cuda(tiny_task_data):
    """G clients at once (vmap, bf16 autocast, CUDA CAPE generators) = one at a time, up to
    bf16 rounding (the padded shapes differ, so the bf16 matmuls round differently)."""
    model, names, algorithm, global_params, clients = _clients_on_cuda(tiny_task_data, 3)
    one = SequentialClientTrainer(model, names, algorithm, AUGMENT, seed=7, device="cuda")
    expected = {
        u: {k: v.clone() for k, v in r.update.items()}
        for u, r in one.train_group(global_params, clients, 5)
    }
    group = ParallelClientTrainer(model, names, algorithm, AUGMENT, 7, "cuda", group_size=4)
    for user, result in group.train_group(global_params, clients, 5):
        for name in names:
            ref = expected[user][name]
            assert ref.abs().max() > 0
            err = (result.update[name] - ref).norm() / ref.norm()
            assert err < 0.05, (user, name, float(err))


def test_a_central_step_on_cuda_with_groups(tiny_task_data):
    recipe = Recipe.model_validate(
        {
            "model": {"preset": "tiny"},
            "federated": {
                "cohort_size": 5,
                "sampling": "fixed",
                "client": {"local_steps": 2, "batch_seconds": 6.0},
            },
            "privacy": {"clipping": "perlayer", "perlayer_mode": "dim", "clip_bound": 1.0},
        }
    )
    params = []
    for parallel in (1, 3):
        torch.manual_seed(0)
        model = build_model("tiny", tiny_task_data.tokenizer.size)
        sim = Simulator(model, tiny_task_data.federated_train, recipe, 1e-3, seed=1,
                        device="cuda", ctx=DistContext(), parallel_clients=parallel)  # fmt: skip
        stats = sim.run_step()
        assert stats["clients"] == 5 and stats["nonfinite_updates"] == 0
        params.append([p.detach().clone() for p in sim.params])
    moved = sum(float((a - b).norm()) for a, b in zip(*params, strict=True))
    total = sum(float(a.norm()) for a in params[0])
    assert 0 <= moved / total < 1e-2


def test_a_whole_run_on_cuda_writes_a_valid_record(env, tmp_path):  # noqa: F811
    run_dir = run(
        _config(env, "perlayer-dim", "eps7.2-high-pop"),
        out_dir=tmp_path / "run",
        options=RunOptions(device="cuda", progress=False),
    )
    record, _ = load_record(run_dir / "record.json")
    assert record.compute.device == "cuda" and record.compute.gpu_hours > 0
    assert record.compute.cfmq.peak_client_memory_bytes > 0
    assert set(record.metrics.final) == {"cv-dev", "cv-test", "ls-dev-clean"}
    assert record.diagnostics.nonfinite_updates == 0


@pytest.mark.parametrize("group_size", [1, 3])
def test_compiled_local_steps_under_cuda_graphs_equal_eager(tiny_task_data, group_size):
    """Inductor on CUDA: the loss under CUDA graphs, the update rule compiled without them, over
    three local steps and two groups in a row. With the update as a second CUDA-graph function,
    its first call freed the backward's gradients it was reading (an H200, 2026-11-27: "accessing
    tensor output of CUDAGraphs that has been overwritten by a subsequent run")."""
    model, names, algorithm, global_params, clients = _clients_on_cuda(tiny_task_data, 4)

    def updates(**options) -> dict:
        args = (model, names, algorithm, AUGMENT, 7, "cuda")
        trainer = (
            SequentialClientTrainer(*args, **options)
            if group_size == 1
            else ParallelClientTrainer(*args, group_size=group_size, **options)
        )
        return {
            user: {k: v.clone() for k, v in result.update.items()}
            for step in (5, 6)
            for user, result in trainer.train_group(global_params, clients, step)
        }

    eager = updates(pad_to_buckets=True)
    compiled = updates(compile_backend="inductor")
    assert compiled.keys() == eager.keys()
    for user, update in compiled.items():
        for name, delta in update.items():
            ref = eager[user][name]
            assert ref.abs().max() > 0
            assert (delta - ref).norm() / ref.norm() < 0.05, (user, name)
