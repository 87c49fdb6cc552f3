"""The run directory of `pflbench run`:

    runs/<task>/<baseline>/<budget>/seed<N>-<hash8>/
        config.json     the resolved RunConfig
        metrics.jsonl   one line per central step (loss, ε so far, lr, diagnostics) and per eval
        tensorboard/    the same scalars as TensorBoard events (when tensorboard is installed)
        checkpoints/    step-XXXXXXX.safetensors (+ .json): model, server state, step, metrics
                        final.safetensors (+ .json): the final model (loadable by load_model)
        errors/         <eval set>.jsonl: per-utterance word/char errors of the final evaluation
        record.json     the result record (pflbench.results.schema.ResultRecord)
        DONE            written last

Every file is written atomically, so a run killed at any moment leaves complete files only.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from pflbench.checkpoint import atomic_write_text
from pflbench.errors import UserError
from pflbench.results.schema import safe_name
from pflbench.spec.models import RunConfig
from pflbench.spec.resolve import canonical_json, config_hash


def default_run_dir(config: RunConfig, root: Path = Path("runs")) -> Path:
    name = f"seed{config.seed}-{config_hash(config)[:8]}"
    return root / config.task.name / config.baseline.name / config.budget.name / name


def is_done(run_dir: Path) -> bool:
    return (run_dir / "DONE").is_file()


def mark_done(run_dir: Path) -> None:
    atomic_write_text(run_dir / "DONE", datetime.now(UTC).isoformat() + "\n")


def prepare_run_dir(config: RunConfig, run_dir: Path, resume: bool) -> None:
    """Create the run directory, or check that an existing one holds this very config.

    An identical run that already finished is accepted without `--resume` (re-running the same
    command, e.g. `make demo`, reports it); an unfinished one needs `--resume`."""
    config_json = json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True)
    existing = run_dir / "config.json"
    if resume or is_done(run_dir):
        if not existing.is_file():
            raise UserError(f"--resume {run_dir}: no config.json there (not a run directory)")
        if canonical_json(json.loads(existing.read_text())) != canonical_json(
            config.model_dump(mode="json")
        ):
            raise UserError(
                f"{run_dir}: its config.json differs from this command's resolved config "
                "(resume with the same --task/--baseline/--budget/--seed/--set, "
                "or choose another --out)"
            )
        return
    if existing.is_file():
        raise UserError(
            f"{run_dir} already holds an unfinished run; continue it with --resume {run_dir} "
            "or choose another --out"
        )
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    atomic_write_text(existing, config_json + "\n")


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete step checkpoint (its JSON sidecar is written last)."""
    done = sorted((run_dir / "checkpoints").glob("step-*.json"))
    return done[-1].with_suffix(".safetensors") if done else None


def prune_checkpoints(run_dir: Path, keep: Path) -> None:
    for old in (run_dir / "checkpoints").glob("step-*"):
        if old.stem != keep.stem:
            old.unlink(missing_ok=True)


def write_utterance_errors(run_dir: Path, results: dict) -> None:
    """errors/<eval set>.jsonl: one line per utterance of the final evaluation (utt_id, speaker,
    word_errors, words, char_errors, chars), for error analysis beyond the record's counts."""
    folder = run_dir / "errors"
    folder.mkdir(exist_ok=True)
    for name, r in results.items():
        lines = [json.dumps(u, sort_keys=True) + "\n" for u in r["utterances"]]
        atomic_write_text(folder / f"{safe_name(name, 'eval set')}.jsonl", "".join(lines))
