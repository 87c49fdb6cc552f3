"""Seed training: LARS, optimizer groups, lr schedule, exact resumption, the seed-model cache."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pflbench.central import (
    SEED_CHECKPOINTS,
    CentralCheckpoints,
    compare_with_shipped,
    epoch_batches,
    seed_model,
    ship_seed_model,
    shipped_seed_path,
    step_decay_lr,
    train_central,
)
from pflbench.checkpoint import ELAPSED, Elapsed, latest_checkpoint, load_checkpoint, load_model
from pflbench.data.batching import collate
from pflbench.data.corpora import Entry
from pflbench.data.prepare import TaskData
from pflbench.data.store import FeatureStore, build_store
from pflbench.data.text import tokenizer_for
from pflbench.digests import tensors_digest
from pflbench.errors import UserError
from pflbench.evaluate import evaluate
from pflbench.model import build_model
from pflbench.model.optim import LARS, make_central_optimizer
from pflbench.model.transformer import ctc_loss
from pflbench.seeds import keyed_seed
from pflbench.spec.models import CentralRecipe, Recipe, SpecAugmentRecipe, Task


def test_lars_scales_matrices_by_trust_ratio_and_leaves_biases_plain():
    w = torch.nn.Parameter(torch.full((2, 2), 3.0))  # ‖w‖ = 6
    b = torch.nn.Parameter(torch.zeros(2))
    w.grad, b.grad = torch.full((2, 2), 0.5), torch.ones(2)  # ‖g_w‖ = 1
    opt = LARS([{"params": [w]}, {"params": [b], "adapt": False}], lr=0.5, trust_coefficient=0.01)
    opt.step()
    # w ← w − lr · (η‖w‖/‖g‖) · g = 3 − 0.5 · 0.06 · 0.5
    torch.testing.assert_close(w.data, torch.full((2, 2), 3 - 0.5 * 0.06 * 0.5))
    torch.testing.assert_close(b.data, torch.full((2,), -0.5))


def test_central_optimizer_excludes_norms_and_biases_from_weight_decay():
    model = build_model("tiny", vocab_size=30)
    for name in ("lars", "adam", "adamw", "sgd"):
        opt = make_central_optimizer(
            model.named_parameters(), CentralRecipe(optimizer=name, weight_decay=0.1)
        )
        decayed, plain = opt.param_groups
        assert all(p.ndim > 1 for p in decayed["params"]) and decayed["weight_decay"] == 0.1
        assert all(p.ndim == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0
        assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert isinstance(make_central_optimizer(model.named_parameters(), CentralRecipe()), LARS)


def test_step_decay_and_warmup():
    r = CentralRecipe(lr=0.5, step_decay_every=100, step_decay_factor=0.5)
    assert [step_decay_lr(r, t) for t in (0, 99, 100, 250)] == [0.5, 0.5, 0.25, 0.125]
    warm = CentralRecipe(lr=1.0, warmup_steps=4)
    assert [step_decay_lr(warm, t) for t in (0, 1, 3, 10)] == [0.25, 0.5, 1.0, 1.0]


TEXTS = ["red fox", "we ran", "a mat", "sat on a mat", "fox ran", "we sat", "red", "on"]


def tone_wave(text: str, rate: int = 16000) -> np.ndarray:
    """'Speech' in which every character is a 60 ms chord whose pitches encode the character."""
    tok = tokenizer_for("en")
    t = np.arange(int(0.06 * rate)) / rate
    chords = [
        np.sin(2 * np.pi * (200 + 90 * i) * t) + np.sin(2 * np.pi * (3000 - 70 * i) * t)
        for i in tok.encode(text)
    ]
    return (0.3 * np.concatenate(chords)).astype(np.float32)


def tone_store(folder: Path, texts: list[str] = TEXTS) -> FeatureStore:
    """A real feature store (log-mel features, Arrow shards) of tone 'speech', 3 speakers."""
    entries = [
        Entry(f"u{i}", f"spk{i % 3}", "train", str(i), text, "librispeech")
        for i, text in enumerate(texts)
    ]

    def read_audio(key: str) -> tuple[np.ndarray, int]:
        return tone_wave(texts[int(key)]), 16000

    return build_store(folder, entries, "en", {}, read_audio=read_audio, workers=1)


RECIPE = CentralRecipe(optimizer="adam", lr=3e-3, steps=4, batch_seconds=0.6)
AUGMENT = SpecAugmentRecipe(time_masks=2, time_width=5)


def test_resumed_training_equals_uninterrupted_training(tmp_path):
    store = tone_store(tmp_path / "store")

    clocks = []

    def trained(steps_then: list[int], folder) -> dict:
        torch.manual_seed(0)
        model = build_model("tiny", vocab_size=tokenizer_for("en").size)
        for steps in steps_then:
            torch.manual_seed(1000 + steps)  # a resumed process starts with other RNG state
            recipe = RECIPE.model_copy(update={"steps": steps})
            clocks.append(Elapsed())  # each process's run clock
            stats = train_central(
                model,
                store,
                recipe,
                AUGMENT,
                device="cpu",
                seed=3,
                progress=False,
                checkpoints=CentralCheckpoints(folder),
                elapsed=clocks[-1],
            )
        return model.state_dict(), stats

    straight, stats = trained([4], tmp_path / "a")
    resumed, resumed_stats = trained([2, 4], tmp_path / "b")
    # The resumed process's clock continues from the first one's checkpointed total, and the
    # last checkpoint holds both processes' time.
    first = clocks[2].before
    assert 0 < first <= clocks[1].seconds()
    _, meta = load_checkpoint(latest_checkpoint(tmp_path / "b", SEED_CHECKPOINTS))
    assert first < meta[ELAPSED] <= clocks[2].seconds()
    assert stats["steps_this_run"] == 4 and resumed_stats["steps_this_run"] == 2
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert stats["final_loss"] > 0 and stats["seconds_of_audio"] > 0
    # the seed sidecar's audio and loss are the whole training's, not the last process's
    assert resumed_stats["final_loss"] == stats["final_loss"]
    assert resumed_stats["seconds_of_audio"] == pytest.approx(stats["seconds_of_audio"])
    # layer freezing's scores cover the whole training, across the resume too
    assert resumed_stats["layer_grad_sq_sums"] == stats["layer_grad_sq_sums"]


def test_a_kill_between_a_checkpoint_s_two_files_resumes_the_same_training(tmp_path, monkeypatch):
    """A checkpoint is two files renamed one after the other. Killed between the two (here: the
    third sidecar's write fails), the training resumes from the previous complete checkpoint and
    ends in the uninterrupted model. Before, one name was rewritten at every checkpoint, and the
    kill left step 3's tensors beside step 2's sidecar: the resume replayed step 3 on top."""
    import pflbench.checkpoint as checkpoint

    store = tone_store(tmp_path / "store")
    recipe = RECIPE.model_copy(update={"steps": 4})

    def trained(folder: Path) -> dict:
        torch.manual_seed(0)
        model = build_model("tiny", vocab_size=tokenizer_for("en").size)
        train_central(
            model, store, recipe, AUGMENT, device="cpu", seed=3, progress=False,
            checkpoints=CentralCheckpoints(folder, every=1),
        )  # fmt: skip
        return model.state_dict()

    straight = trained(tmp_path / "a")
    real_write, sidecars = checkpoint.atomic_write_text, []

    def killed_at_the_third_sidecar(path, text):
        sidecars.append(path)
        if len(sidecars) == 3:
            raise KeyboardInterrupt("killed")
        real_write(path, text)

    monkeypatch.setattr(checkpoint, "atomic_write_text", killed_at_the_third_sidecar)
    with pytest.raises(KeyboardInterrupt):
        trained(tmp_path / "b")
    monkeypatch.setattr(checkpoint, "atomic_write_text", real_write)
    _, meta = load_checkpoint(latest_checkpoint(tmp_path / "b", SEED_CHECKPOINTS))
    assert meta["step"] == 2
    resumed = trained(tmp_path / "b")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert [p.name for p in sorted((tmp_path / "b").iterdir())] == [
        "central-0000004.json", "central-0000004.safetensors",
    ]  # fmt: skip


def test_seed_training_sums_each_parameters_squared_gradient_norm_before_clipping(tmp_path):
    """Paper 003 scores layers by ‖∂L/∂θ_h‖² summed over the whole public training: after one
    step the sums are exactly that step's squared gradient norms (taken before clipping)."""
    store = tone_store(tmp_path / "store")
    recipe = RECIPE.model_copy(update={"steps": 1, "grad_clip": 1e-3})
    augment = SpecAugmentRecipe(enabled=False)
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=tokenizer_for("en").size, dropout=0.0, layer_drop=0.0)
    by_hand = build_model("tiny", vocab_size=tokenizer_for("en").size, dropout=0.0, layer_drop=0.0)
    by_hand.load_state_dict(model.state_dict())
    stats = train_central(model, store, recipe, augment, device="cpu", seed=3, progress=False)

    utterances = list(store)
    first = next(epoch_batches([u.seconds for u in utterances], recipe, 3))
    batch = collate([utterances[i] for i in first])
    by_hand.train()
    torch.manual_seed(keyed_seed(3, "step", 0))  # CAPE draws as the training step did
    log_probs, out_lens = by_hand(batch.feats, batch.feat_lens)
    ctc_loss(log_probs, out_lens, batch.targets, batch.target_lens).backward()
    expected = {n: float(p.grad.double().norm() ** 2) for n, p in by_hand.named_parameters()}
    sums = stats["layer_grad_sq_sums"]
    assert list(sums) == list(expected)
    assert sum(expected.values()) > recipe.grad_clip**2  # so clipping would have changed them
    for name, value in expected.items():
        assert abs(sums[name] - value) <= 1e-4 * value + 1e-12, name


def _seeded_task(tmp_path, texts: list[str] = TEXTS):
    task = Task.model_validate(
        {
            "name": "t",
            "version": 1,
            "language": "en",
            "description": "",
            "seed_data": {"corpus": "librispeech", "subsets": ["train-clean-100"]},
            "federated_data": {"corpus": "commonvoice", "subsets": ["train"], "locale": "en"},
            "eval_sets": [
                {"name": "d", "corpus": "librispeech", "subset": "dev-clean", "role": "dev"}
            ],
        }
    )
    recipe = Recipe.model_validate({"model": {"preset": "tiny"}, "central": RECIPE.model_dump()})
    data = TaskData(
        tokenizer=tokenizer_for("en"),
        seed_train=tone_store(tmp_path / "store", texts),
        federated_train=None,
        eval_sets={},
        report={},
    )
    return task, recipe, data


def test_seed_model_is_trained_once_then_reused(tmp_path):
    task, recipe, data = _seeded_task(tmp_path)
    model, path = seed_model(
        task, recipe, data, seed=1, device="cpu", cache_dir=tmp_path, progress=False
    )
    assert path.is_file() and path.with_suffix(".json").is_file()
    assert [p.name for p in path.parent.iterdir() if "last" in p.name] == []
    stamp = path.stat().st_mtime_ns
    again, same_path = seed_model(
        task, recipe, data, seed=1, device="cpu", cache_dir=tmp_path, progress=False
    )
    assert same_path == path and path.stat().st_mtime_ns == stamp
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    _, other = seed_model(
        task, recipe, data, seed=2, device="cpu", cache_dir=tmp_path, progress=False
    )
    assert other != path
    loaded, meta = load_model(path)
    assert meta["kind"] == "seed" and meta["training"]["steps"] == 4 and meta["seed"] == 1
    assert set(meta["training"]["layer_grad_sq_sums"]) == {n for n, _ in model.named_parameters()}


def test_runs_start_from_the_shipped_seed_model_digest_checked(tmp_path):
    """A seed model shipped for the spec is what seed_model returns wherever its local training
    would differ (here: other seed data), copied into the cache once its digest is checked; a
    damaged shipped file is refused; compare_with_shipped tells matching from differing."""
    task, recipe, data = _seeded_task(tmp_path / "a")
    vocab = data.tokenizer.vocab
    shipped = shipped_seed_path(task, recipe, 1, vocab, tmp_path / "shipped")
    trained, path = seed_model(
        task, recipe, data, seed=1, device="cpu", cache_dir=tmp_path / "a", progress=False
    )
    assert compare_with_shipped(path, shipped)["matches"] is None  # nothing shipped yet
    ship_seed_model(path, shipped)
    assert compare_with_shipped(path, shipped)["matches"] is True

    _, _, other_data = _seeded_task(tmp_path / "b", TEXTS[:6])  # other seed data elsewhere
    cache = tmp_path / "b"
    model, used = seed_model(task, recipe, other_data, seed=1, device="cpu", cache_dir=cache,
                             progress=False, shipped_dir=shipped.parent)  # fmt: skip
    assert used.is_relative_to(cache) and tensors_digest(used) == tensors_digest(shipped)
    assert not list((cache / "seeds").glob(f"{task.name}-*"))  # nothing trained here
    for (name, a), b in zip(trained.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    _, own = seed_model(
        task, recipe, other_data, seed=1, device="cpu", cache_dir=cache, progress=False
    )
    check = compare_with_shipped(own, shipped)
    assert check["matches"] is False and check["same_seed_data_digest"] is False

    damaged = load_model(shipped)[0].state_dict()
    damaged["head.bias"] = damaged["head.bias"] + 1
    save_file(damaged, str(shipped))
    with pytest.raises(UserError, match="hash to"):
        seed_model(task, recipe, data, seed=1, device="cpu", cache_dir=tmp_path / "c",
                   progress=False, shipped_dir=shipped.parent)  # fmt: skip


def test_a_task_without_seed_data_gets_a_seeded_fresh_model(tmp_path):
    task = Task.model_validate(
        {
            "name": "s",
            "version": 1,
            "language": "en",
            "description": "",
            "federated_data": {"corpus": "commonvoice", "subsets": ["train"], "locale": "en"},
            "eval_sets": [
                {"name": "d", "corpus": "librispeech", "subset": "dev-clean", "role": "dev"}
            ],
        }
    )
    data = TaskData(
        tokenizer=tokenizer_for("en"),
        seed_train=None,
        federated_train=None,
        eval_sets={},
        report={},
    )
    recipe = Recipe.model_validate({"model": {"preset": "tiny"}})
    a, path = seed_model(task, recipe, data, seed=5, device="cpu", cache_dir=tmp_path)
    b, _ = seed_model(task, recipe, data, seed=5, device="cpu", cache_dir=tmp_path)
    assert path is None
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_seed_training_overfits_tone_speech_to_zero_wer(tmp_path):
    """End to end on a real feature store: batching, training, greedy decoding, WER."""
    store = tone_store(tmp_path / "store")
    tok = tokenizer_for("en")
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=tok.size)
    before = evaluate(model, store, tok, device="cpu")
    recipe = CentralRecipe(optimizer="adam", lr=3e-3, steps=150, batch_seconds=10.0)
    stats = train_central(
        model, store, recipe, SpecAugmentRecipe(enabled=False), device="cpu", seed=0, progress=False
    )
    after = evaluate(model, store, tok, device="cpu", batch_seconds=1.0)
    assert before["wer"] > 0.5 and after["wer"] == 0.0 and after["cer"] == 0.0
    assert after["per_speaker"] == {"spk0": 0.0, "spk1": 0.0, "spk2": 0.0}
    assert (after["num_utterances"], after["num_words"]) == (8, sum(len(t.split()) for t in TEXTS))
    assert stats["steps_this_run"] == 150 and stats["seconds_of_audio"] > 0


def _seed_weights(tmp_path, caller_threads: int) -> dict[str, torch.Tensor]:
    task, recipe, data = _seeded_task(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(caller_threads)
    try:
        model, _ = seed_model(
            task, recipe, data, seed=1, device="cpu", cache_dir=tmp_path / "cache", progress=False
        )
        assert torch.get_num_threads() == caller_threads  # restored after seed training
    finally:
        torch.set_num_threads(before)
    return model.state_dict()


def test_the_seed_model_does_not_depend_on_the_callers_thread_count(tmp_path):
    """A sweep with --jobs 2 runs with one thread, a lone run with all cores: both must start
    from the same seed weights (float sums depend on the thread count)."""
    one, two = _seed_weights(tmp_path / "a", 1), _seed_weights(tmp_path / "b", 2)
    for name, a in one.items():
        assert torch.equal(a, two[name]), name


def test_a_task_of_another_name_with_the_same_seed_spec_starts_from_the_shipped_model():
    """A copy of the embedded task in an outside folder, renamed (and its federated phase cut),
    has the shipped task's seed spec: it finds the model shipped for that spec, named for the
    task that shipped it, instead of training one; a changed seed recipe does not."""
    from pflbench.central import START_MODEL_SEED, shipped_seed_dir
    from pflbench.spec.registry import load_registry
    from pflbench.spec.resolve import resolve

    config = resolve(load_registry(), "synth-cv-en-ls-seed", "perlayer-dim", "none", 0)
    vocab = tokenizer_for(config.task.language).vocab
    shipped = shipped_seed_path(
        config.task, config.recipe, START_MODEL_SEED, vocab, shipped_seed_dir()
    )
    assert shipped.is_file() and shipped.name.startswith("synth-cv-en-ls-seed-v")
    copy = config.task.model_copy(update={"name": "mysynth-short", "version": 1})
    assert (
        shipped_seed_path(copy, config.recipe, START_MODEL_SEED, vocab, shipped_seed_dir())
        == shipped
    )
    longer = config.recipe.model_copy(
        update={"central": config.recipe.central.model_copy(update={"steps": 7})}
    )
    other = shipped_seed_path(copy, longer, START_MODEL_SEED, vocab, shipped_seed_dir())
    assert other.name.startswith("mysynth-short-v1-") and not other.exists()
