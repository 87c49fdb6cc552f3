"""The compiled local step (fl.client, `run --compile`): no graph breaks, the eager step's updates
up to float rounding, and padding to bucket sizes that changes nothing but rounding. The compiles
use the aot_eager backend (dynamo and AOTAutograd without inductor's code generation): the graph
capture is the one inductor gets, in seconds."""

import pytest
import torch
import torch.nn.functional as F
from conftest import largest_users, make_algorithm
from torch._dynamo.utils import counters

from pflbench.data.batching import collate, padded_size
from pflbench.fl.client import SequentialClientTrainer
from pflbench.fl.parallel import ParallelClientTrainer
from pflbench.model.transformer import build_model, compiled_ctc_losses, ctc_losses
from pflbench.spec.models import ClientRecipe, SpecAugmentRecipe

# vmap's warning for SDPA on CPU (no batching rule: a loop), from the pieces traced here alone
pytestmark = pytest.mark.filterwarnings("ignore:.*performance drop")

AUGMENT = SpecAugmentRecipe(freq_masks=1, freq_width=8, time_masks=1, time_width=10)
STEP = 5  # the central step the clients train at


def _trainer(data, group_size: int, batch_seconds: float = 6.0, layer_drop=None, **options):
    torch.manual_seed(0)
    model = build_model("tiny", data.tokenizer.size, layer_drop=layer_drop)
    recipe = ClientRecipe(batch_seconds=batch_seconds, lr=0.5, local_steps=2)
    names = [n for n, _ in model.named_parameters()]
    algorithm = make_algorithm(recipe, model, names, seed=7)
    args = (model, names, algorithm, AUGMENT, 7, "cpu")
    if group_size == 1:
        return model, SequentialClientTrainer(*args, **options)
    return model, ParallelClientTrainer(*args, group_size=group_size, **options)


def _updates(data, group_size: int, **options) -> dict[str, tuple[float, dict]]:
    """user -> (loss, update) of two clients trained at STEP."""
    model, trainer = _trainer(data, group_size, **options)
    torch.manual_seed(1)  # the layer-drop draws (the default generator)
    global_params = [p.detach() for p in model.parameters()]
    clients = largest_users(data.federated_train, 2)
    return {
        user: (result.loss, {k: v.clone() for k, v in result.update.items()})
        for user, result in trainer.train_group(global_params, clients, STEP)
    }


def _assert_close(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for user, (loss, update) in got.items():
        assert loss == pytest.approx(expected[user][0], rel=1e-4)
        for name, delta in update.items():
            assert expected[user][1][name].abs().max() > 0
            torch.testing.assert_close(delta, expected[user][1][name], rtol=1e-3, atol=2e-6)


@pytest.mark.parametrize("group_size", [1, 2])
def test_the_compiled_local_step_has_no_graph_break_and_the_eager_updates(
    tiny_task_data, group_size
):
    eager = _updates(tiny_task_data, group_size)
    torch._dynamo.reset()
    counters.clear()
    compiled = _updates(tiny_task_data, group_size, compile_backend="aot_eager")
    # Over every compilation of the training (shapes change between local steps): the loss and
    # the update rule were compiled, and dynamo never broke a graph.
    assert counters["stats"]["unique_graphs"] >= 2
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_close(compiled, eager)


def test_layer_drop_compiles_without_graph_breaks_to_the_eager_updates(tiny_task_data):
    # paper-255m drops each of its 36 blocks with probability 0.3: eagerly a branch on a draw,
    # which compiled broke the graph at every block. Both draw from the default generator here
    # (aot_eager runs the graph's ops eagerly), so they skip the same blocks.
    eager = _updates(tiny_task_data, 1, layer_drop=0.5)
    losses = {user: loss for user, (loss, _) in _updates(tiny_task_data, 1).items()}
    assert {user: loss for user, (loss, _) in eager.items()} != losses, "no block was dropped"
    torch._dynamo.reset()
    counters.clear()
    compiled = _updates(tiny_task_data, 1, layer_drop=0.5, compile_backend="aot_eager")
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_close(compiled, eager)


@pytest.mark.parametrize("group_size", [1, 2])
def test_padding_to_buckets_changes_eager_updates_only_by_rounding(tiny_task_data, group_size):
    # 20 s batches: up to 9 utterances (padded to 10), of frame counts that are no bucket size
    _, trainer = _trainer(tiny_task_data, group_size, 20.0, pad_to_buckets=True)
    batch = collate(largest_users(tiny_task_data.federated_train, 2)[1][1])
    (utterances, frames), words = batch.feats.shape[:2], batch.targets.shape[1]
    padded = trainer._group_inputs({0: batch})
    assert utterances == 9 and padded_size(frames) > frames
    assert padded.feats.shape[1:3] == (10, padded_size(frames))
    assert padded.targets.shape[2] == padded.positions.shape[2] > words

    plain = _updates(tiny_task_data, group_size, batch_seconds=20.0)
    padded = _updates(tiny_task_data, group_size, batch_seconds=20.0, pad_to_buckets=True)
    _assert_close(padded, plain)


def test_padded_sizes_are_few_and_pad_by_under_a_quarter():
    assert [padded_size(n) for n in (1, 7, 8, 9, 11, 17, 100, 129, 500, 1000)] == [
        1, 7, 8, 10, 12, 20, 112, 160, 512, 1024,
    ]  # fmt: skip
    sizes = [padded_size(n) for n in range(1, 4097)]
    assert all(n <= p < 1.25 * n for n, p in enumerate(sizes, start=1))
    assert sizes == sorted(sizes) and len(set(sizes[99:])) == 22  # 100..4096: 4 an octave


def test_the_compiled_ctc_operator_computes_the_eager_losses_and_gradients_bitwise():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, 12, generator=generator)
    log_probs = F.log_softmax(logits, dim=-1).requires_grad_()
    out_lens = torch.tensor([40, 31, 5])
    targets = torch.randint(1, 12, (3, 9), generator=generator)
    target_lens = torch.tensor([9, 6, 8])  # the last cannot align in 5 frames: loss 0, not inf
    weights = torch.tensor([0.5, 2.0, 1.0])
    results = []
    for ctc in (ctc_losses, compiled_ctc_losses):
        losses = ctc(log_probs, out_lens, targets, target_lens)
        (grad,) = torch.autograd.grad((losses * weights).sum(), log_probs)
        results.append((losses.detach(), grad))
    (losses, grad), (op_losses, op_grad) = results
    assert losses[2] == 0 and grad[2].abs().sum() == 0 and grad[:2].abs().sum() > 0
    assert torch.equal(op_losses, losses) and torch.equal(op_grad, grad)
