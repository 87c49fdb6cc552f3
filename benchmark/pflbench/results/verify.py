"""`pflbench verify RUN_DIR`: evaluate a finished run's final checkpoint again and compare.

Re-scoring (rescore.py) shows that the record's figures follow from the stored hypotheses;
verifying shows that the hypotheses follow from the checkpoint. It checks that
checkpoints/final.safetensors is the checkpoint the record names (`outputs.final_model`, a
digest of its tensors), evaluates it on the task's eval sets with the runner's own evaluation,
and compares with the record:

- on the run's setup (same torch version, device and device name; on a CPU the same vendor and
  kernels, `compute.cpu` but its model name, and the record's intra-op thread count), exactly:
  every figure of `metrics.final`, and the hypotheses themselves (their sha256 is the record's);
- on another setup, kernels round differently and a few hypotheses may change: per eval set the
  same number of utterances, and pooled WER and CER within TOLERANCE (absolute; 0.01 = 1 point).

On success it writes verification.json into the run directory, a stamp that `pflbench submit`
checks against the record and files beside it; the leaderboard marks such rows "re-evaluated".
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, ValidationError

from pflbench import __version__
from pflbench.central import set_cpu_threads
from pflbench.checkpoint import load_model
from pflbench.data.prepare import EvalData
from pflbench.data.store import FeatureStore
from pflbench.digests import tensors_digest
from pflbench.errors import UserError
from pflbench.evaluate import eval_summary, evaluate_task
from pflbench.files import atomic_write_text
from pflbench.numerics import NUMERICS_CHANGES, NUMERICS_VERSION
from pflbench.results.leaderboard import VERIFICATION_FILE, filed_dir
from pflbench.results.record import cpu_info, device_name
from pflbench.results.rescore import (
    DataOptions,
    check_eval_data,
    first_difference,
    recheck_record,
)
from pflbench.results.schema import (
    RECORD_ID_PATTERN,
    SHA256_PATTERN,
    EvalResult,
    ResultRecord,
    Strict,
    load_record,
    read_json_file,
    record_numerics_version,
)
from pflbench.results.submit import check_config
from pflbench.rundir import HYPOTHESES_DIR, check_finished, hypotheses_content
from pflbench.spec.models import Task
from pflbench.spec.registry import format_validation_error
from pflbench.spec.resolve import canonical_json

TOLERANCE = 0.01  # |WER or CER re-evaluated − recorded| on another setup, absolute


class Setup(Strict):
    """What a re-evaluation must share with the run to reproduce its numbers bit for bit."""

    torch_version: str
    device: str
    device_name: str | None
    intra_op_threads: int | None  # CPU only
    # CPU only: vendor, ISA and kernel settings (CpuKernels but its model name). A CPU's device
    # name is only its architecture (x86_64): another vendor's computes other features.
    cpu: dict[str, Any] | None = None


class EvalFigures(Strict):
    wer: float
    cer: float | None
    num_utterances: int | None


class Verification(Strict):
    """The stamp: which record and checkpoint, where, how compared, and what came out."""

    record_id: str = Field(pattern=RECORD_ID_PATTERN)
    final_model: str = Field(pattern=SHA256_PATTERN)
    created: str
    pflbench_version: str
    setup: Setup
    exact: bool  # the run's setup: compared exactly, else within TOLERANCE
    eval: dict[str, EvalFigures]


def run_setup(record: ResultRecord) -> Setup:
    cpu, kernels = record.compute.device == "cpu", record.compute.cpu
    return Setup(
        torch_version=record.software.torch_version if record.software else "",
        device=record.compute.device or "",
        device_name=record.compute.device_name,
        intra_op_threads=record.compute.intra_op_threads if cpu else None,
        cpu=kernels.model_dump(exclude={"model"}) if cpu and kernels is not None else None,
    )


def this_setup(device: str, threads: int) -> Setup:
    cuda = device.startswith("cuda")
    return Setup(
        torch_version=torch.__version__,
        device="cuda" if cuda else "cpu",
        device_name=device_name(device),
        intra_op_threads=None if cuda else threads,
        cpu=None if cuda else cpu_info().model_dump(exclude={"model"}),
    )


def within_tolerance(claimed: float | None, fresh: float | None) -> bool:
    if claimed is None or fresh is None:
        return claimed is fresh
    return abs(claimed - fresh) <= TOLERANCE


def check_figures(record: ResultRecord, figures: dict[str, EvalFigures], exact: bool, where: str):
    """The re-evaluated figures against the record's: equal, or within TOLERANCE."""
    if sorted(figures) != sorted(record.metrics.final):
        raise UserError(
            f"{where}: re-evaluated eval sets {sorted(figures)}, the record has "
            f"{sorted(record.metrics.final)}"
        )
    for name, fresh in figures.items():
        claimed = record.metrics.final[name]
        for key in ("num_utterances", "wer", "cer"):
            a, b = getattr(claimed, key), getattr(fresh, key)
            ok = a == b if exact or key == "num_utterances" else within_tolerance(a, b)
            if not ok:
                how = "exactly (same setup)" if exact else f"within {TOLERANCE} (another setup)"
                raise UserError(
                    f"{where}: metrics.final.{name}.{key} is {a!r} in the record, but the final "
                    f"checkpoint re-evaluated gives {b!r} (compared {how})"
                )


def verify_run(
    run_dir: Path, device: str = "cpu", data: DataOptions = DataOptions()
) -> Verification:
    """Re-evaluate a finished run's final checkpoint (module docstring); writes the stamp."""
    run_dir = Path(run_dir)
    check_finished(run_dir)
    where = str(run_dir / "record.json")
    record, raw = load_record(run_dir / "record.json")
    if record.kind != "run":
        raise UserError(f"{where}: only run records can be verified (kind is {record.kind!r})")
    if record_numerics_version(record) != NUMERICS_VERSION:  # its transcripts decode otherwise
        raise UserError(
            f"{where}: the run's code computed numbers as numerics version "
            f"{record_numerics_version(record)}, this pflbench as {NUMERICS_VERSION} "
            f"({NUMERICS_CHANGES.get(NUMERICS_VERSION, '')}): verify it with the pflbench that "
            "ran it"
        )
    outputs = record.outputs
    config = check_config(record, raw, where)
    final = run_dir / "checkpoints" / "final.safetensors"
    if not final.is_file():
        raise UserError(f"{final}: no such file (the run's final checkpoint)")
    digest = tensors_digest(final)
    if digest != outputs.final_model:
        raise UserError(
            f"{final}: its tensors' digest is {digest}, but the record's outputs.final_model is "
            f"{outputs.final_model}: this is not the checkpoint the record was written from"
        )
    eval_data = data.eval_data(config.task)
    check_eval_data(record, eval_data, where)
    recorded = run_setup(record)
    threads_before = torch.get_num_threads()
    try:
        if device == "cpu" and recorded.device == "cpu" and recorded.intra_op_threads:
            torch.set_num_threads(recorded.intra_op_threads)  # kernels round as in the run
        else:
            set_cpu_threads()
        here = this_setup(device, torch.get_num_threads())
        model, _ = load_model(final, device)
        results = evaluate_task(model, eval_data, config.task.eval_sets, {"dev", "test"}, device)
    finally:
        torch.set_num_threads(threads_before)
    summary = {n: EvalResult.model_validate(r) for n, r in eval_summary(results).items()}
    exact = here == recorded
    figures = {
        n: EvalFigures(wer=r.wer, cer=r.cer, num_utterances=r.num_utterances)
        for n, r in summary.items()
    }
    check_figures(record, figures, exact, where)
    if exact:  # every figure, and the transcripts themselves
        for name, result in summary.items():
            claimed = record.metrics.final[name].model_dump(mode="json")
            found = first_difference(
                claimed, result.model_dump(mode="json"), f"metrics.final.{name}"
            )
            if found is not None:
                field, a, b = found
                raise UserError(
                    f"{where}: {field} is {a!r} in the record, but the final checkpoint "
                    f"re-evaluated gives {b!r} (compared exactly: same setup)"
                )
            fresh = hashlib.sha256(hypotheses_content(results[name]["utterances"])).hexdigest()
            if fresh != outputs.hypotheses[name]:
                raise UserError(
                    f"{where}: the final checkpoint re-evaluated transcribes {name!r} otherwise "
                    f"than the stored hypotheses (sha256 {fresh}, the record's "
                    f"outputs.hypotheses[{name!r}] is {outputs.hypotheses[name]})"
                )
    stamp = Verification(
        record_id=record.record_id,
        final_model=digest,
        created=datetime.now(UTC).isoformat(),
        pflbench_version=__version__,
        setup=here,
        exact=exact,
        eval=figures,
    )
    text = json.dumps(stamp.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    atomic_write_text(run_dir / VERIFICATION_FILE, text)
    return stamp


# ----------------------------------------------------------------------------------------------
# The stamp, at submit and once filed


def load_stamp(path: Path) -> Verification:
    try:
        return Verification.model_validate(read_json_file(path))
    except ValidationError as exc:
        text = format_validation_error(str(path), exc)
        raise UserError(text.replace("invalid spec", "invalid verification stamp")) from None


def check_stamp(stamp: Verification, record: ResultRecord, where: str) -> None:
    """A stamp belongs to the record, names its checkpoint, and its figures are the record's."""
    outputs = record.outputs
    if stamp.record_id != record.record_id or stamp.final_model != outputs.final_model:
        raise UserError(
            f"{where}: it verifies record {stamp.record_id} (checkpoint {stamp.final_model}), "
            f"not this record {record.record_id} (checkpoint {outputs.final_model}); run "
            "`pflbench verify` again"
        )
    # An exact comparison is one made on the run's own setup (`verify` decides it so): a stamp
    # claiming one elsewhere would hold the record to nothing.
    setup = run_setup(record)
    if stamp.exact and stamp.setup != setup:
        raise UserError(
            f"{where}: the stamp claims an exact comparison, but its setup is not the run's"
            f" ({stamp.setup.model_dump()} against {setup.model_dump()}); run `pflbench verify`"
            " again"
        )
    check_figures(record, stamp.eval, stamp.exact, where)


def check_filed_stamp(record: ResultRecord, folder: Path, where: str) -> None:
    """A filed record's verification stamp, where it has one, checked against it."""
    path = Path(folder) / VERIFICATION_FILE
    if path.is_file():
        check_stamp(load_stamp(path), record, f"{path} (of {where})")


def reevaluated_ids(files: list[tuple[Path, ResultRecord, dict]]) -> set[str]:
    """Records filed with a verification stamp, each stamp checked against its record first
    (check_filed_stamp): the leaderboard's "re-evaluated" needs a stamp that names the record's
    final model and figures, not only a file of that name."""
    found = set()
    for path, record, _ in files:
        folder = filed_dir(path)
        if (folder / VERIFICATION_FILE).is_file():
            check_filed_stamp(record, folder, str(path))
            found.add(record.record_id)
    return found


# ----------------------------------------------------------------------------------------------
# Filed records (CI: `pflbench results rescore`)


@dataclass
class RecheckReport:
    rescored: list[Path]
    references: int  # paper rows: nothing to re-score
    # Re-scored records whose data matched by the audio digest only (other features here).
    audio_only: list[Path]


def recheck_filed(files: list[tuple[Path, ResultRecord, dict]], data: DataOptions) -> RecheckReport:
    """Re-score filed records (`leaderboard.load_result_files`' triples) from their filed
    hypotheses, check each one's population against the training data and its verification
    stamp where it has one; each task's data are prepared once."""
    report = RecheckReport([], 0, [])
    evals: dict[str, EvalData] = {}
    federated: dict[str, FeatureStore] = {}  # prepared only where a record states a population

    def federated_data(key: str, task: Task) -> FeatureStore:
        if key not in federated:
            federated[key] = data.federated_data(task)
        return federated[key]

    for path, record, raw in files:
        if record.kind != "run":
            report.references += 1
            continue
        config = check_config(record, raw, str(path))
        task = config.task
        key = canonical_json(task.model_dump(mode="json"))
        if key not in evals:
            evals[key] = data.eval_data(task)
        folder = filed_dir(path)
        audio_only = recheck_record(
            record,
            config,
            folder / HYPOTHESES_DIR,
            evals[key],
            functools.partial(federated_data, key, task),
            str(path),
        )
        check_filed_stamp(record, folder, str(path))
        report.rescored.append(path)
        if audio_only:
            report.audio_only.append(path)
    return report
