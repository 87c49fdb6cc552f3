"""Checkpoints: tensors in safetensors (no pickle, safe to load from anyone) + a JSON sidecar.

    seed.safetensors   the tensors
    seed.json          config, data digests, training stats — written last, so a checkpoint
                       is complete exactly when its JSON exists

Both files are written to a temporary name and renamed, so a crash never leaves a torn file. A
training's checkpoints each have their own name (`step-0000040`, `central-0000040`) and the older
ones are pruned only once a newer one is complete: the pair of files is not renamed at once, so a
kill between the two renames of a rewritten name would pair one save's tensors with another's
sidecar.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from pflbench.errors import UserError
from pflbench.files import atomic_write, atomic_write_text
from pflbench.model.transformer import CTCTransformer, ModelConfig

ELAPSED = "elapsed_seconds"  # a checkpoint's metadata: the job's wall seconds up to it


class Elapsed:
    """The wall seconds of a resumable job over all its processes: each checkpoint stores the
    total so far (meta ELAPSED) and a resumed job continues from it, so a record's compute is
    the work that made the result, not only its last process's. Time a killed process spent
    after its last checkpoint is redone, and counted once."""

    def __init__(self) -> None:
        self.before, self.started = 0.0, time.perf_counter()

    def resume(self, meta: dict) -> None:
        """Continue from a checkpoint's total (0 for checkpoints written before it was kept)."""
        self.before = float(meta.get(ELAPSED, 0.0))

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.started


def meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def save_checkpoint(path: Path, tensors: dict[str, Tensor], meta: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    atomic_write(path, lambda tmp: save_file(cpu, str(tmp)))
    text = json.dumps(meta, indent=2, sort_keys=True, default=str)
    atomic_write_text(meta_path(path), text)


def step_checkpoint(folder: Path, prefix: str, step: int) -> Path:
    """Where a training's checkpoint after `step` steps goes: `folder/prefix-NNNNNNN`."""
    return Path(folder) / f"{prefix}-{step:07d}.safetensors"


def latest_checkpoint(folder: Path, prefix: str) -> Path | None:
    """The newest complete step_checkpoint in `folder` (its JSON sidecar is written last)."""
    name = re.compile(rf"{re.escape(prefix)}-\d{{7}}\.json")
    done = sorted(p for p in Path(folder).glob(f"{prefix}-*.json") if name.fullmatch(p.name))
    return done[-1].with_suffix(".safetensors") if done else None


def prune_checkpoints(folder: Path, prefix: str, keep: Path) -> None:
    """Remove `folder`'s other `prefix-*` checkpoints (complete or not) and the temporary files a
    killed write left of them, once `keep` is complete."""
    for old in [*Path(folder).glob(f"{prefix}-*"), *Path(folder).glob(f".{prefix}-*.tmp")]:
        if old.stem != keep.stem:
            old.unlink(missing_ok=True)


def load_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path}: {'a folder' if path.is_dir() else 'no such file'}")
    if not meta_path(path).is_file():
        raise UserError(f"checkpoint {path}: its sidecar {meta_path(path).name} is missing")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"checkpoint {path}: not a readable safetensors file ({exc})") from None
    try:
        meta = json.loads(meta_path(path).read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"checkpoint {meta_path(path)}: not valid JSON ({exc})") from None
    return tensors, meta


# ----------------------------------------------------------------------------------------------
# Models


def model_meta(model: CTCTransformer) -> dict:
    return {"model_config": asdict(model.cfg), "vocab_size": model.vocab_size}


def save_model(path: Path, model: CTCTransformer, meta: dict) -> None:
    save_checkpoint(path, model.state_dict(), {**meta, **model_meta(model)})


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[CTCTransformer, dict]:
    """Rebuild the model a checkpoint describes and load its weights (strictly)."""
    tensors, meta = load_checkpoint(path)
    if "model_config" not in meta or "vocab_size" not in meta:
        raise UserError(f"checkpoint {path}: its JSON has no model_config/vocab_size")
    model = CTCTransformer(ModelConfig(**meta["model_config"]), int(meta["vocab_size"]))
    model_tensors = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
    try:
        model.load_state_dict(model_tensors, strict=True)
    except RuntimeError as exc:
        raise UserError(
            f"checkpoint {path}: weights do not match its model_config ({exc})"
        ) from None
    return model.to(device), meta
