"""Several clients at once (vmap over stacked parameters) equal one client at a time."""

import json
import platform

import pytest
import torch
from conftest import largest_users, make_algorithm
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.fl.client import SequentialClientTrainer
from pflbench.fl.distributed import DistContext
from pflbench.fl.parallel import ParallelClientTrainer
from pflbench.fl.simulator import Simulator
from pflbench.model.transformer import build_model
from pflbench.privacy import aggregate
from pflbench.spec.models import ClientRecipe, Recipe, SpecAugmentRecipe

AUGMENT = SpecAugmentRecipe(freq_masks=1, freq_width=8, time_masks=1, time_width=10)
CLIENT_VARIANTS = {
    "steps": {"local_steps": 3},
    # Clients with different numbers of local steps; FedProx, variational noise, data limit.
    "epochs+prox": {
        "local_steps": None,
        "local_epochs": 1,
        "algorithm": "fedprox",
        "fedprox_mu": 0.5,
    },
    "epochs+noise": {
        "local_steps": None,
        "local_epochs": 1,
        "algorithm": "fvn",
        "variational_noise": {"std": 0.01},
    },
    "data-limit": {"local_steps": 3, "algorithm": "data-limit", "max_utterances": 2},
}


@pytest.mark.parametrize("variant", sorted(CLIENT_VARIANTS))
def test_group_updates_equal_one_client_at_a_time(tiny_task_data, variant):
    torch.manual_seed(0)
    model = build_model("tiny", tiny_task_data.tokenizer.size)
    recipe = ClientRecipe(**{"batch_seconds": 6.0, "lr": 0.5, **CLIENT_VARIANTS[variant]})
    names = [n for n, _ in model.named_parameters()][2:]  # some frozen tensors too
    global_params = [dict(model.named_parameters())[n].detach() for n in names]
    clients = largest_users(tiny_task_data.federated_train, 3)

    one = SequentialClientTrainer(model, names, make_algorithm(recipe, model, names, seed=7),
                                  AUGMENT, seed=7, device="cpu")  # fmt: skip
    expected = {}
    for user, result in one.train_group(global_params, clients, 5):
        expected[user] = (result, {k: v.clone() for k, v in result.update.items()})
    group = ParallelClientTrainer(model, names, make_algorithm(recipe, model, names, seed=7),
                                  AUGMENT, seed=7, device="cpu", group_size=4)  # fmt: skip
    results = list(group.train_group(global_params, clients, 5))

    assert [u for u, _ in results] == [u for u, _ in clients]
    assert len({expected[u][0].local_steps for u, _ in clients}) > variant.startswith("epochs")
    for user, result in results:
        ref, ref_update = expected[user]
        assert (result.local_steps, result.frames) == (ref.local_steps, ref.frames)
        assert result.loss == pytest.approx(ref.loss, rel=1e-4)
        for name in names:
            assert ref_update[name].abs().max() > 0
            torch.testing.assert_close(result.update[name], ref_update[name], rtol=1e-3, atol=2e-6)


def test_a_central_step_with_groups_matches_one_at_a_time(tiny_task_data):
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
    for parallel in (1, 3):  # 5 clients: a group of 3, then a group of 2
        torch.manual_seed(0)
        model = build_model("tiny", tiny_task_data.tokenizer.size)
        sim = Simulator(model, tiny_task_data.federated_train, recipe, 0.0, seed=1,
                        device="cpu", ctx=DistContext(), parallel_clients=parallel)  # fmt: skip
        stats = sim.run_step()
        assert stats["clients"] == 5
        params.append([p.clone() for p in sim.params])
    for a, b in zip(*params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_dropout_or_layer_drop_is_refused():
    model = build_model("tiny", 30, dropout=0.1)
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(UserError, match="dropout and layer drop 0"):
        algorithm = make_algorithm(ClientRecipe(), model, names)
        ParallelClientTrainer(model, names, algorithm, AUGMENT, 0, "cpu", group_size=2)


@pytest.mark.slow
def test_bench_fl_reports_the_parallel_speedup():
    args = ["bench", "fl", "--preset", "tiny", "--cohort", "4", "--local-steps", "1",
            "--parallel-clients", "2", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)  # the phases' lines go to stderr, as they end
    assert "one_at_a_time: first central step" in result.stderr
    assert "peak memory at cohort 64" in result.stderr
    assert figures["parallel_clients"] == 2 and figures["cohort"] == 4
    # the speed-up is the ratio of the two timed central steps, each a positive duration
    one, grouped = (
        figures["central_step_seconds_one_client_at_a_time"],
        figures["central_step_seconds"],
    )
    assert one > 0 and grouped > 0
    assert figures["parallel_speedup"] == pytest.approx(one / grouped, rel=1e-12)
    # client training is timed inside the central step: a fraction of its wall time is outside
    assert 0 <= figures["outside_client_fraction"] < 1 and figures["local_step_seconds"] > 0
    assert 0 < figures["aggregation_fraction"] <= figures["outside_client_fraction"]
    # On a CPU the privacy path's C kernels ran it where they are built (setup.py), and on x86-64
    # both (the norms kernel sums as ATen does there)
    built = aggregate._kernels is not None
    if platform.machine() in ("x86_64", "AMD64"):
        assert figures["cpu_kernels"] == {"exact_sum": built, "fp64_norms": built}
