"""`pflbench results reproduce`: run filed records again from their configs and compare.

Re-scoring (rescore.py) shows that a record's WERs follow from its filed hypotheses, and
`pflbench verify` that the hypotheses follow from a checkpoint. Neither shows that the checkpoint
came from the run the record describes: a no-DP model filed as a DP run, a run moved to another
budget, or hypotheses made up and scored honestly pass both. Running the record's config again
does show it, because a CPU run is deterministic:

- on the filer's setup (torch build, CPU kernels, intra-op threads, processes, parallel clients,
  compile backend, pflbench's numerics version) the re-run must end in the record's final model,
  hypotheses, metrics, privacy statement, diagnostics, data and cohorts, bit for bit;
- on another setup kernels round differently and training drifts: the data (the feature digests
  aside: another CPU computes other features from the same audio), the privacy statement (its
  numbers within what two machines' accountants agree to: within_statement_slack) and the
  sampled cohorts (integer randomness) must still be the record's, and each eval set's pooled
  WER within RERUN_TOLERANCE of it.

Each re-run is `pflbench run` in a subprocess (sweep.py's runner), with the record's thread count.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pflbench.errors import UserError
from pflbench.numerics import NUMERICS_VERSION
from pflbench.results.rescore import differences, first_difference
from pflbench.results.schema import ResultRecord, load_record, record_numerics_version
from pflbench.results.submit import what_ran, within_statement_slack
from pflbench.results.sweep import PlannedRun

RERUN_TOLERANCE = 0.03  # |pooled WER re-run − recorded| on another setup (3 points ≈ 2 seed SDs)

# Compared exactly on the filer's setup; on another, only the fields training floats cannot move.
EXACT_FIELDS = ("outputs", "metrics", "privacy", "diagnostics", "data")
SETUP_FREE_FIELDS = ("privacy", "data")


def run_setup(record: ResultRecord) -> dict[str, Any]:
    """What a re-run must share with the run to repeat its floats bit for bit (the numerics
    version whose numbers the run's are: a run no change since touches has today's)."""
    compute, software = record.compute, record.software
    cpu = compute.cpu.model_dump(exclude={"model"}) if compute.cpu is not None else None
    return {
        "torch_version": software.torch_version if software else None,
        "numerics_version": record_numerics_version(record),
        "device": compute.device,
        "device_name": compute.device_name,
        "cpu": cpu if compute.device == "cpu" else None,
        "intra_op_threads": compute.intra_op_threads if compute.device == "cpu" else None,
        "num_processes": compute.num_processes,
        "parallel_clients": compute.parallel_clients,
        "compile_backend": compute.compile_backend,
    }


def why_not_rerunnable(
    record: ResultRecord, cuda_available: bool, task_version: int | None
) -> str | None:
    """None where this machine can re-run the record, else why not. `task_version`: the
    registry's version of the record's task. A stale row (an older task version or numerics)
    ran another recipe or other code: this pflbench cannot give its numbers again."""
    if record.kind != "run":
        return "a paper's reference row"
    if (record.compute.device or "cpu").startswith("cuda") and not cuda_available:
        return "run on CUDA; no GPU here"
    if task_version is not None and record.task.version != task_version:
        return f"run on task version {record.task.version}; the task is version {task_version} now"
    if record_numerics_version(record) != NUMERICS_VERSION:
        return (
            f"run by code of numerics version {record_numerics_version(record)}; this pflbench "
            f"computes as version {NUMERICS_VERSION}"
        )
    return None


def rerun_plan(
    record: ResultRecord, path: Path, out_root: Path, extra_args: tuple[str, ...] = ()
) -> PlannedRun:
    """`pflbench run` with the record's task, baseline, budget, seed, --set overrides and the run
    options its numbers depend on (and `extra_args`: --specs, --plugin, --data-root)."""
    config = record.config or {}
    compute = record.compute
    args = ["--no-progress", "--device", "cuda" if compute.device == "cuda" else "cpu"]
    if (compute.num_processes or 1) > 1:
        args += ["--nproc", str(compute.num_processes)]
    if (compute.parallel_clients or 1) > 1:
        args += ["--parallel-clients", str(compute.parallel_clients)]
    if compute.compile_backend is not None:
        args.append("--compile")
    return PlannedRun(
        task=record.task.name,
        baseline=record.baseline,
        budget=record.budget,
        seed=record.seed if record.seed is not None else 0,
        sets=tuple(f"{key}={value}" for key, value in (config.get("overrides") or {}).items()),
        run_dir=Path(out_root) / path.stem,
        run_args=(*args, *extra_args),
        threads=compute.intra_op_threads if compute.device == "cpu" else None,
    )


def sample_records(
    candidates: list[tuple[Path, ResultRecord]],
    count: int,
    key: str,
    max_wall_seconds: float | None,
) -> list[tuple[Path, ResultRecord]]:
    """`count` records picked by `key` (CI: the commit, so each commit re-runs others), among
    those whose filed run took at most `max_wall_seconds`; the same key picks the same ones."""
    within = [
        item
        for item in candidates
        if max_wall_seconds is None or (item[1].compute.wall_seconds or 0) <= max_wall_seconds
    ]
    order = sorted(
        within, key=lambda item: hashlib.sha256(f"{key}:{item[1].record_id}".encode()).hexdigest()
    )
    return order[:count]


@dataclass
class Comparison:
    exact: bool  # compared on the run's own setup
    setup_differences: list[str]  # where this setup differs from the run's (exact: none)
    wer: dict[str, tuple[float, float]]  # eval set -> (recorded, re-run)


def compare_rerun(filed: ResultRecord, fresh: ResultRecord, where: str) -> Comparison:
    """The re-run's record against the filed one (module docstring); raises on a mismatch."""
    ran = first_difference(what_ran(filed.config or {}), what_ran(fresh.config or {}), "config")
    if ran is not None:
        field, stored, resolved = ran
        raise UserError(
            f"{where}: the re-run resolved another config ({field} is {stored!r} in the record, "
            f"{resolved!r} now): its task, baseline or budget specs changed since it was filed"
        )
    ours, theirs = run_setup(fresh), run_setup(filed)
    setup_differences = [
        f"{name}: {theirs[name]!r} filed, {ours[name]!r} here"
        for name in theirs
        if ours[name] != theirs[name]
    ]
    exact = not setup_differences
    fields = EXACT_FIELDS if exact else SETUP_FREE_FIELDS
    claimed, rerun = filed.model_dump(mode="json"), fresh.model_dump(mode="json")
    if not exact:
        claimed["data"], rerun["data"] = _without_feature_digests(claimed["data"], rerun["data"])
    # In this order, so a mismatch names the model before the metrics that follow from it.
    # Another CPU's FFTs round the numerical accountants' (PLD, PRV) ε differently in the last
    # digits: there the statement's numbers agree within the slack `results validate` allows.
    found = next(
        (
            diff
            for name in fields
            for diff in differences(claimed[name], rerun[name], f"record.{name}")
            if exact or not (name == "privacy" and within_statement_slack(*diff))
        ),
        None,
    )
    if found is None and filed.compute.cohort_per_step != fresh.compute.cohort_per_step:
        found = (
            "compute.cohort_per_step",
            filed.compute.cohort_per_step,
            fresh.compute.cohort_per_step,
        )
    wer = {
        name: (result.wer, fresh.metrics.final[name].wer)
        for name, result in filed.metrics.final.items()
        if name in fresh.metrics.final
    }
    if found is None and not exact:
        found = next(
            (
                (f"metrics.final.{name}.wer", a, b)
                for name, (a, b) in wer.items()
                if abs(a - b) > RERUN_TOLERANCE
            ),
            None,
        )
    if found is not None:
        field, a, b = found
        how = (
            "bit for bit (the run's own setup)"
            if exact
            else (
                f"on another setup ({'; '.join(setup_differences)}), WER within {RERUN_TOLERANCE}"
            )
        )
        raise UserError(
            f"{where}: does not reproduce: {field} is {a!r} in the record, {b!r} in the re-run "
            f"(compared {how})"
        )
    return Comparison(exact, setup_differences, wer)


def _without_feature_digests(filed: dict | None, fresh: dict | None) -> tuple[Any, Any]:
    """Both records' data without the feature digests of the sets whose audio digests agree:
    another CPU computes other features from the same audio (docs/RESULTS.md); the audio digests
    (utterances, users, texts, decoded audio) are still compared, as is everything else."""
    if not filed or not fresh:
        return filed, fresh
    audio, fresh_audio = filed.get("audio_digests") or {}, fresh.get("audio_digests") or {}
    same_audio = {name for name, digest in audio.items() if fresh_audio.get(name) == digest}

    def kept(data: dict) -> dict:
        digests = data.get("digests") or {}
        return {**data, "digests": {k: v for k, v in digests.items() if k not in same_audio}}

    return kept(filed), kept(fresh)


def load_rerun(run: PlannedRun) -> ResultRecord:
    return load_record(run.run_dir / "record.json")[0]
