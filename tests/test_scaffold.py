"""SCAFFOLD (pflbench/fl/algorithms/scaffold.py): the corrected local step, the control-variate
update and what is sent, the server's control, one joint DP bound, and exact resume."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_algorithm, make_mechanism

from pflbench.fl.aggregate import StepAggregator
from pflbench.fl.algorithms.scaffold import PREFIX
from pflbench.fl.client import SequentialClientTrainer
from pflbench.fl.distributed import DistContext
from pflbench.fl.parallel import ParallelClientTrainer
from pflbench.fl.simulator import Simulator
from pflbench.model.transformer import build_model
from pflbench.spec.models import ClientRecipe, PrivacyRecipe, Recipe, SpecAugmentRecipe

AUGMENT = SpecAugmentRecipe(enabled=False)
CLIENT = {"algorithm": "scaffold", "local_steps": 2, "batch_seconds": 6.0, "lr": 0.5}


def _setup(tiny_task_data, **client):
    torch.manual_seed(0)
    model = build_model("tiny", tiny_task_data.tokenizer.size)
    recipe = ClientRecipe(**{**CLIENT, **client})
    names = [n for n, _ in model.named_parameters()]
    store = tiny_task_data.federated_train
    users = sorted(store.users(), key=lambda u: (-store.user_num_utterances(u), u))[:3]
    return model, recipe, names, [(u, store.load_user(u)) for u in users]


def _random_state(algorithm, users, seed=1):
    """A server control c and control variates c_i for `users` (saved at step 0)."""
    gen = torch.Generator().manual_seed(seed)
    for c in algorithm.server_control:
        c.copy_(0.01 * torch.randn(c.shape, generator=gen))
    for user in users:
        state = {n: 0.01 * torch.randn(p.shape, generator=gen) for n, p in zip(
            algorithm.context.names, algorithm.context.params, strict=True)}  # fmt: skip
        algorithm.context.user_states.save(user, 0, state)


def _train(trainer, model, clients, step=1):
    params = [p.detach() for p in model.parameters()]
    return {u: {k: v.clone() for k, v in r.update.items()} for u, r in trainer.train_group(
        params, clients, step)}  # fmt: skip


def test_local_step_is_corrected_and_controls_follow_option_two(tiny_task_data):
    """One local step with no local clipping: Δ_scaffold − Δ_fedavg = lr·(c − c_i); then
    c_i⁺ = c_i − c + Δ/(K lr) is stored and s·(c_i⁺ − c_i) is sent."""
    model, recipe, names, clients = _setup(tiny_task_data, local_steps=1, grad_clip=1e9)
    scaffold = make_algorithm(recipe, model, names)
    _random_state(scaffold, [u for u, _ in clients])
    trainer = SequentialClientTrainer(model, names, scaffold, AUGMENT, 0, "cpu")
    fedavg = SequentialClientTrainer(
        model, names, make_algorithm(ClientRecipe(**{**CLIENT, "algorithm": "fedavg",
        "local_steps": 1, "grad_clip": 1e9}), model, names), AUGMENT, 0, "cpu")  # fmt: skip
    corrected, plain = _train(trainer, model, clients), _train(fedavg, model, clients)
    c = dict(zip(names, scaffold.server_control, strict=True))
    for user, _ in clients:
        old = scaffold.context.user_states.load(user, 1)
        new = scaffold.context.user_states.load(user, 2)
        for n in names:
            drift = c[n] - old[n]
            # Δ = θ − (θ − lr (∇ + c − c_i)): the correction's share of Δ is lr (c − c_i)
            torch.testing.assert_close(corrected[user][n] - plain[user][n], 0.5 * drift,
                                       rtol=1e-4, atol=1e-6)  # fmt: skip
            expected = old[n] - c[n] + corrected[user][n] / 0.5
            torch.testing.assert_close(new[n], expected, rtol=1e-5, atol=1e-7)
            sent = corrected[user][PREFIX + n]
            torch.testing.assert_close(
                sent, scaffold.scale * (new[n] - old[n]), rtol=1e-5, atol=1e-8
            )


def test_controls_are_projected_onto_the_local_clip_bound(tiny_task_data):
    model, recipe, names, clients = _setup(tiny_task_data, grad_clip=1e-3)
    scaffold = make_algorithm(recipe, model, names)
    _random_state(scaffold, [u for u, _ in clients])  # c_i − c far outside the bound
    trainer = SequentialClientTrainer(model, names, scaffold, AUGMENT, 0, "cpu")
    sent = _train(trainer, model, clients)
    for user, _ in clients:
        new = scaffold.context.user_states.load(user, 2)
        norm = math.sqrt(sum(float(t.square().sum()) for t in new.values()))
        assert 0.99e-3 < norm <= 1e-3 * (1 + 1e-5)
    # From projected controls on, ‖s·Δc_i‖ ≤ 2·s·C_loc: the exact sum's range holds.
    sent = _train(trainer, model, clients, step=2)
    for user, _ in clients:
        payload = [sent[user][PREFIX + n] for n in names]
        norm = math.sqrt(sum(float(t.square().sum()) for t in payload))
        assert 0 < norm <= scaffold.payload_bound(0.0) * (1 + 1e-5)


def test_stacked_clients_equal_one_at_a_time(tiny_task_data):
    model, recipe, names, clients = _setup(tiny_task_data)
    results = []
    for trainer_class, extra in (
        (SequentialClientTrainer, {}),
        (ParallelClientTrainer, {"group_size": 4}),
    ):
        algorithm = make_algorithm(recipe, model, names)
        _random_state(algorithm, [u for u, _ in clients])
        trainer = trainer_class(model, names, algorithm, AUGMENT, 0, "cpu", **extra)
        results.append((_train(trainer, model, clients), algorithm))
    (one, alg_one), (group, alg_group) = results
    for user, _ in clients:
        assert set(one[user]) == set(group[user]) and len(one[user]) == 2 * len(names)
        for key in one[user]:
            torch.testing.assert_close(group[user][key], one[user][key], rtol=1e-3, atol=2e-6)
        a, b = (
            alg_one.context.user_states.load(user, 2),
            alg_group.context.user_states.load(user, 2),
        )
        for n in names:
            torch.testing.assert_close(a[n], b[n], rtol=1e-3, atol=2e-5)


@pytest.mark.parametrize("clipping", ["global", "perlayer"])
def test_the_payload_is_clipped_as_one_update(tiny_task_data, clipping):
    """Δ and the control-variate update share one bound C: the average of S clipped payloads
    has norm ≤ C, and the control half is not empty."""
    model, recipe, names, clients = _setup(tiny_task_data)
    scaffold = make_algorithm(recipe, model, names)
    _random_state(scaffold, [u for u, _ in clients])
    trainer = SequentialClientTrainer(model, names, scaffold, AUGMENT, 0, "cpu")
    like = dict(zip(names, scaffold.context.params, strict=True)) | scaffold.payload_like()
    bound = 1e-3
    privacy = PrivacyRecipe(clipping=clipping, perlayer_mode="dim", clip_bound=bound)
    aggregator = StepAggregator(like, make_mechanism(privacy, len(clients)), 1, 10.0)
    params = [p.detach() for p in model.parameters()]
    for user, result in trainer.train_group(params, clients, 1):
        aggregator.add(result.update, user, result.loss, result.local_steps, result.frames)
    averaged, stats = aggregator.finish()
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(averaged)))
    control = torch.stack(torch._foreach_norm(averaged[len(names) :])).norm()
    assert stats["diagnostics"]["clipped_fraction"] == 1.0
    assert norm <= bound * (1 + 1e-5) and control > 0.05 * bound


def test_server_control_moves_by_q_times_the_average_over_s(tiny_task_data):
    model, recipe, names, _ = _setup(tiny_task_data)
    scaffold = make_algorithm(recipe, model, names, sampling_rate=0.25)
    averaged = {PREFIX + n: torch.full_like(p, 2.0) for n, p in zip(
        names, scaffold.context.params, strict=True)}  # fmt: skip
    scaffold.server_step(averaged)
    expected = 0.25 * 2.0 / scaffold.scale
    assert all(torch.allclose(c, torch.full_like(c, expected)) for c in scaffold.server_control)


def _recipe(state: dict | None = None) -> Recipe:
    return Recipe.model_validate({
        "model": {"preset": "tiny"},
        "federated": {"cohort_size": 3, "sampling": "fixed",
                      "client": {**CLIENT, "local_steps": 1}},
        "privacy": {"clipping": "perlayer", "perlayer_mode": "dim", "clip_bound": 0.05},
    })  # fmt: skip


def _sim(tiny_task_data, folder):
    torch.manual_seed(0)
    model = build_model("tiny", tiny_task_data.tokenizer.size)
    return Simulator(model, tiny_task_data.federated_train, _recipe(), 1e-2, seed=3, device="cpu",
                     ctx=DistContext(), user_state_dir=folder)  # fmt: skip


def test_resume_after_a_kill_reads_the_same_user_states(tiny_task_data, tmp_path):
    """A run killed after writing step 3's user states, resumed from its step-2 checkpoint,
    ends bitwise where the uninterrupted run does."""
    straight = _sim(tiny_task_data, tmp_path / "straight")
    for _ in range(5):
        straight.run_step()
    killed = _sim(tiny_task_data, tmp_path / "killed")
    for _ in range(2):
        killed.run_step()
    checkpoint = {k: v.clone() for k, v in killed.state_dict().items()}
    killed.checkpointed()
    killed.run_step()  # writes states at step 2, then the process dies
    killed.run_step()
    resumed = _sim(tiny_task_data, tmp_path / "killed")
    resumed.load_state_dict(checkpoint)
    for _ in range(3):
        resumed.run_step()
    assert any(float(c.abs().max()) > 0 for c in resumed.algorithm.server_control)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
