"""Checkpoints: safetensors + JSON sidecar round-trip; loading never unpickles."""

import json
import multiprocessing
import pickle
import time
from pathlib import Path

import pytest
import torch

from pflbench.checkpoint import (
    load_checkpoint,
    load_model,
    save_checkpoint,
    save_model,
)
from pflbench.digests import tensors_digest
from pflbench.errors import UserError
from pflbench.model import build_model


def test_model_round_trip(tmp_path):
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=30, dropout=0.0)
    path = tmp_path / "ckpt" / "seed.safetensors"
    save_model(path, model, {"task": "x", "data_digest": "abc"})
    loaded, meta = load_model(path)
    assert meta["task"] == "x" and meta["data_digest"] == "abc"
    assert loaded.cfg == model.cfg and loaded.vocab_size == 30
    for (name, a), (_, b) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert sorted(p.name for p in path.parent.iterdir()) == ["seed.json", "seed.safetensors"]


def test_tensors_and_meta_round_trip(tmp_path):
    tensors = {"w": torch.randn(3, 4), "step": torch.tensor(7.0), "i": torch.arange(5)}
    save_checkpoint(tmp_path / "c.safetensors", tensors, {"step": 7, "nested": {"a": [1, 2]}})
    back, meta = load_checkpoint(tmp_path / "c.safetensors")
    assert meta == {"step": 7, "nested": {"a": [1, 2]}}
    assert all(torch.equal(tensors[k], back[k]) for k in tensors)


class Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


def test_a_pickle_is_refused_not_unpickled(tmp_path):
    path = tmp_path / "evil.safetensors"
    path.write_bytes(pickle.dumps({"w": Boom()}))
    (tmp_path / "evil.json").write_text(json.dumps({"model_config": {}, "vocab_size": 3}))
    with pytest.raises(UserError, match="not a readable safetensors"):
        load_checkpoint(path)
    torch.save({"w": Boom()}, path)  # a torch pickle zip, too
    with pytest.raises(UserError, match="not a readable safetensors"):
        load_model(path)


def test_a_missing_checkpoint_or_a_folder_is_named_as_such(tmp_path):
    with pytest.raises(UserError, match="m.safetensors: no such file"):
        load_checkpoint(tmp_path / "m.safetensors")
    with pytest.raises(UserError, match=f"checkpoint {tmp_path}: a folder"):
        load_checkpoint(tmp_path)


def test_missing_sidecar_and_mismatched_weights_are_user_errors(tmp_path):
    path = tmp_path / "m.safetensors"
    save_model(path, build_model("tiny", vocab_size=30), {})
    meta = json.loads((tmp_path / "m.json").read_text())
    meta["vocab_size"] = 31
    (tmp_path / "m.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="do not match"):
        load_model(path)
    (tmp_path / "m.json").unlink()
    with pytest.raises(UserError, match="sidecar"):
        load_checkpoint(path)


def _hold_lock_and_log(lock_path: str, log_path: str, name: str, hold_s: float) -> None:
    from pflbench.files import exclusive

    with exclusive(Path(lock_path)):
        with open(log_path, "a") as log:
            log.write(f"{name}-in\n")
        time.sleep(hold_s)
        with open(log_path, "a") as log:
            log.write(f"{name}-out\n")


def test_exclusive_serializes_processes_sharing_a_cache(tmp_path):
    """Two sweep jobs building the same cached artifact: the second waits for the first."""
    lock, log = tmp_path / "cache" / "prepare.lock", tmp_path / "log.txt"
    ctx = multiprocessing.get_context("spawn")
    first = ctx.Process(target=_hold_lock_and_log, args=(str(lock), str(log), "a", 1.0))
    first.start()
    deadline = time.monotonic() + 30
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    second = ctx.Process(target=_hold_lock_and_log, args=(str(lock), str(log), "b", 0.0))
    second.start()
    first.join(30)
    second.join(30)
    assert first.exitcode == 0 and second.exitcode == 0
    assert log.read_text().split() == ["a-in", "a-out", "b-in", "b-out"]


def test_tensors_digest_covers_step_checkpoints_scalars_and_every_byte(tmp_path):
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(7, dtype=torch.int64)}
    save_checkpoint(tmp_path / "a.safetensors", tensors, {})
    digest = tensors_digest(tmp_path / "a.safetensors")  # 0-dim tensors included
    save_checkpoint(tmp_path / "b.safetensors", {**tensors, "step": torch.tensor(8)}, {})
    save_checkpoint(tmp_path / "c.safetensors", {**tensors, "w": tensors["w"].reshape(3, 2)}, {})
    others = {tensors_digest(tmp_path / f"{n}.safetensors") for n in "bc"}
    assert digest not in others and len(others) == 2
