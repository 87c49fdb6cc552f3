"""A run's metrics log: `metrics.jsonl` always, TensorBoard event files too when installed.

Lines are the runner's dicts: a training line per central step ({"step", "loss", "epsilon_rdp",
"lr", "step_seconds", "clients", "nonfinite_updates", "diagnostics", ...}; a DP-SGD step has
"examples" and "nonfinite_examples" instead of "clients" and "nonfinite_updates") and an eval line
({"step", "eval": {set: {"wer", "cer"}}}). A training line's "step" is the step's index, an eval
line's the number of steps done; TensorBoard's x axis is steps done for both. On resume the log
restarts from the checkpoint's lines: the JSONL file is rewritten from them and TensorBoard purges
events after the checkpoint's step, so neither shows the lost steps twice.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from pflbench.files import atomic_write_text

TENSORBOARD_DIR = "tensorboard"
# Scalars of a training line, by TensorBoard tag.
TRAINING_SCALARS = {
    "train/loss": ("loss",),
    "train/lr": ("lr",),
    "train/clients": ("clients",),
    "train/examples": ("examples",),
    "train/nonfinite_updates": ("nonfinite_updates",),
    "train/nonfinite_examples": ("nonfinite_examples",),
    "privacy/epsilon_rdp": ("epsilon_rdp",),
    "time/step_seconds": ("step_seconds",),
    "diagnostics/clipped_fraction": ("diagnostics", "clipped_fraction"),
    "diagnostics/update_norm_before_noise": ("diagnostics", "update_norm_before_noise"),
    "diagnostics/update_norm_after_noise": ("diagnostics", "update_norm_after_noise"),
}


def tensorboard_writer(log_dir: Path, purge_step: int):
    """A SummaryWriter, or None when the tensorboard package is not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tensorboard's own deprecation warnings on import
            from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(log_dir), purge_step=purge_step)


def _get(line: dict, path: tuple[str, ...]):
    for key in path:
        line = line.get(key) if isinstance(line, dict) else None
    return line


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class MetricsLog:
    """Appends lines to run_dir/metrics.jsonl and mirrors their scalars to TensorBoard."""

    def __init__(self, run_dir: Path, lines: list[dict], steps_done: int):
        """`lines`: the history so far (from a checkpoint), rewritten to the file; `append`
        extends this very list, so the caller's history and the file stay one."""
        self.lines = lines
        self.path = Path(run_dir) / "metrics.jsonl"
        text = "".join(json.dumps(x) + "\n" for x in lines)
        atomic_write_text(self.path, text)
        self.tensorboard = tensorboard_writer(Path(run_dir) / TENSORBOARD_DIR, steps_done + 1)
        self.file = open(self.path, "a")  # noqa: SIM115 (closed by close())

    def append(self, lines: list[dict]) -> None:
        self.lines += lines
        self.file.write("".join(json.dumps(x) + "\n" for x in lines))
        self.file.flush()
        for line in lines:
            self._scalars(line)
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def _scalars(self, line: dict) -> None:
        if self.tensorboard is None:
            return
        add = self.tensorboard.add_scalar
        if "eval" in line:
            for name, result in line["eval"].items():
                for metric in ("wer", "cer"):
                    if _is_number(result.get(metric)):
                        add(f"eval/{name}/{metric}", result[metric], line["step"])
            return
        step = line["step"] + 1
        for tag, path in TRAINING_SCALARS.items():
            value = _get(line, path)
            if _is_number(value):
                add(tag, value, step)
        for layer, norm in (_get(line, ("diagnostics", "layer_norm_mean")) or {}).items():
            add(f"layer_norm_mean/{layer}", norm, step)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
