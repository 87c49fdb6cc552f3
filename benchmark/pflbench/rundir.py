"""The run directory of `pflbench run`:

    runs/<task>/<baseline>/<budget>/seed<N>-<hash8>/
        config.json     the resolved RunConfig
        metrics.jsonl   one line per central step (loss, ε so far, lr, diagnostics) and per eval
        tensorboard/    the same scalars as TensorBoard events (when tensorboard is installed)
        checkpoints/    step-XXXXXXX.safetensors (+ .json): model, server state, step, metrics
                        final.safetensors (+ .json): the final model (loadable by load_model)
        errors/         <eval set>.jsonl: per-utterance word/char errors of the final evaluation
        hypotheses/     <eval set>.jsonl.gz: each utterance's id and hypothesis in the final
                        evaluation (their sha256 is in the record: `pflbench submit` re-scores them)
        record.json     the result record (pflbench.results.schema.ResultRecord)
        DONE            written last
        verification.json   written by `pflbench verify` when the final checkpoint, evaluated
                        again, gives the record's numbers (results/verify.py)

Every file is written atomically, so a run killed at any moment leaves complete files only.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from datetime import UTC, datetime
from pathlib import Path

from pflbench.errors import UserError
from pflbench.files import atomic_write, atomic_write_text
from pflbench.spec.models import RunConfig
from pflbench.spec.names import safe_name
from pflbench.spec.resolve import canonical_json, config_hash, ran_hash


def default_run_dir(config: RunConfig, root: Path = Path("runs")) -> Path:
    name = f"seed{config.seed}-{config_hash(config)[:8]}"
    return root / config.task.name / config.baseline.name / config.budget.name / name


def is_done(run_dir: Path) -> bool:
    return (run_dir / "DONE").is_file()


def check_finished(run_dir: Path, hint: str = "") -> None:
    """Refuse, by what is wrong, a path that is not a finished run directory."""
    if not run_dir.exists():
        why = "no such folder"
    elif not run_dir.is_dir():
        why = "a file, not a run directory"
    elif not is_done(run_dir):
        why = "not a finished run (no DONE marker)"
    else:
        return
    raise UserError(f"{run_dir}: {why}{hint}")


def mark_done(run_dir: Path) -> None:
    atomic_write_text(run_dir / "DONE", datetime.now(UTC).isoformat() + "\n")


def prepare_run_dir(config: RunConfig, run_dir: Path, resume: bool) -> None:
    """Create the run directory, or check that an existing one holds this very config.

    An identical run that already finished is accepted without `--resume` (re-running the same
    command, e.g. `make demo`, reports it); an unfinished one needs `--resume`. A run whose
    baseline or budget was only reworded since it began (spec.resolve.WORDS) is the same run; it
    goes on with its own config (config_to_continue)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir}: a file, not a run directory; choose another --out")
    config_json = json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True)
    existing = run_dir / "config.json"
    if resume or is_done(run_dir):
        if not existing.is_file():
            raise UserError(f"--resume {run_dir}: no config.json there (not a run directory)")
        stored = json.loads(existing.read_text())
        if ran_hash(stored, without=()) != ran_hash(config.model_dump(mode="json"), without=()):
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


def config_to_continue(config: RunConfig, run_dir: Path) -> RunConfig:
    """The config a prepared run goes on with: its own config.json, where that differs from
    `config` only in the specs' words (prepare_run_dir accepted it), so that its checkpoints and
    record keep the config it began with; else `config`."""
    stored = json.loads((run_dir / "config.json").read_text())
    if canonical_json(stored) == canonical_json(config.model_dump(mode="json")):
        return config
    return RunConfig.model_validate(stored)


ERROR_KEYS = ("utt_id", "speaker", "word_errors", "words", "char_errors", "chars")


def write_utterance_errors(run_dir: Path, results: dict) -> None:
    """errors/<eval set>.jsonl: one line per utterance of the final evaluation (utt_id, speaker,
    word_errors, words, char_errors, chars), for error analysis beyond the record's counts."""
    folder = run_dir / "errors"
    folder.mkdir(exist_ok=True)
    for name, r in results.items():
        lines = [
            json.dumps({k: u[k] for k in ERROR_KEYS}, sort_keys=True) + "\n"
            for u in r["utterances"]
        ]
        atomic_write_text(folder / f"{safe_name(name, 'eval set')}.jsonl", "".join(lines))


# ----------------------------------------------------------------------------------------------
# Hypotheses: what the final model transcribed, kept so that the record's WER/CER can be computed
# again from the data's references (results/rescore.py). The same files are filed in results/.

HYPOTHESES_DIR = "hypotheses"
MAX_HYPOTHESES_BYTES = 256 * 1024 * 1024  # uncompressed; a 16k-utterance eval set is ~2 MB


def hypotheses_file(folder: Path, eval_set: str) -> Path:
    return Path(folder) / f"{safe_name(eval_set, 'eval set')}.jsonl.gz"


def hypotheses_content(utterances: list[dict]) -> bytes:
    """A hypotheses file's content: one line per utterance of an evaluation (evaluate.score's
    "utterances"), {"hypothesis", "utt_id"}, sorted by utt_id."""
    pairs = sorted((u["utt_id"], u["hypothesis"]) for u in utterances)
    lines = [json.dumps({"hypothesis": h, "utt_id": u}, sort_keys=True) for u, h in pairs]
    return "".join(line + "\n" for line in lines).encode()


def write_hypotheses(folder: Path, results: dict) -> dict[str, str]:
    """<eval set>.jsonl.gz per eval set of `results` (evaluate_task's); returns the sha256 of each
    file's uncompressed content, which the record names (gzip's bytes depend on zlib)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, r in results.items():
        content = hypotheses_content(r["utterances"])
        packed = gzip.compress(content, mtime=0)
        atomic_write(hypotheses_file(folder, name), lambda tmp, b=packed: tmp.write_bytes(b))
        digests[name] = hashlib.sha256(content).hexdigest()
    return digests


def read_hypotheses(path: Path) -> tuple[dict[str, str], str]:
    """(utt_id -> hypothesis, sha256 of the uncompressed content) of a hypotheses file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file (the run's hypotheses of this eval set)")
    try:
        with gzip.open(path, "rb") as handle:
            content = handle.read(MAX_HYPOTHESES_BYTES + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise UserError(f"{path}: not a readable gzip file ({exc})") from None
    if len(content) > MAX_HYPOTHESES_BYTES:
        raise UserError(f"{path}: over {MAX_HYPOTHESES_BYTES} bytes uncompressed")
    try:
        text = content.decode()
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc})") from None
    hypotheses: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if not (
            isinstance(item, dict)
            and set(item) == {"hypothesis", "utt_id"}
            and all(isinstance(v, str) for v in item.values())
        ):
            raise UserError(f'{path}: line {number} is not {{"hypothesis": str, "utt_id": str}}')
        if item["utt_id"] in hypotheses:
            raise UserError(f"{path}: line {number} repeats utterance {item['utt_id']!r}")
        hypotheses[item["utt_id"]] = item["hypothesis"]
    return hypotheses, hashlib.sha256(content).hexdigest()
