"""Building a run's result record (results.schema.ResultRecord) from what the run measured."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from pflbench import __version__
from pflbench.digests import tensors_digest
from pflbench.evaluate import eval_summary
from pflbench.files import atomic_write_text
from pflbench.numerics import NUMERICS_VERSION, cpu_kernels, package_versions
from pflbench.plugins import loaded_plugins
from pflbench.results.schema import (
    RECORD_SCHEMA_VERSION,
    Compute,
    CpuKernels,
    DataInfo,
    Diagnostics,
    EvalResult,
    HistoryPoint,
    Metrics,
    Outputs,
    PluginInfo,
    PrivacyClaim,
    ResultRecord,
    Software,
    TaskRef,
    compute_record_id,
)
from pflbench.spec.models import RunConfig
from pflbench.spec.resolve import config_hash

UNSET_ID = "0" * 16  # a record's id hashes its content, so it is set last


def build_record(
    config: RunConfig,
    *,
    lines: list[dict],
    final: dict,
    seed_summary: dict | None,
    privacy: dict,
    compute: Compute,
    data: DataInfo,
    outputs: Outputs,
) -> ResultRecord:
    """The record of a finished run. `lines`: its metrics.jsonl lines (central steps and evals);
    `final`: the final evaluate_task results; `seed_summary`: the seed model's eval_summary;
    `outputs`: the digests of its final checkpoint and stored hypotheses."""
    steps = [x for x in lines if "loss" in x]
    fractions = [x["diagnostics"]["clipped_fraction"] for x in steps]
    fractions = [f for f in fractions if f is not None]
    record = ResultRecord(
        record_id=UNSET_ID,
        schema_version=RECORD_SCHEMA_VERSION,
        created=datetime.now(UTC).isoformat(),
        kind="run",
        provenance=None,
        task=TaskRef(name=config.task.name, version=config.task.version),
        baseline=config.baseline.name,
        budget=config.budget.name,
        seed=config.seed,
        config_hash=config_hash(config),
        config=config.model_dump(mode="json"),
        metrics=Metrics(
            final=_eval_results(eval_summary(final)),
            seed_model=_eval_results(seed_summary) if seed_summary else None,
            history=[
                HistoryPoint(step=x["step"], eval_set=name, wer=r["wer"], cer=r["cer"])
                for x in lines
                if "eval" in x
                for name, r in x["eval"].items()
            ],
        ),
        privacy=PrivacyClaim.model_validate(privacy),
        compute=compute,
        software=software_info(),
        data=data,
        diagnostics=Diagnostics(
            private=False,  # computed from raw client updates, like metrics.jsonl's
            nonfinite_updates=sum(x["nonfinite_updates"] for x in steps),
            clipped_fraction_mean=sum(fractions) / len(fractions) if fractions else None,
        ),
        outputs=outputs,
    )
    content = record.model_dump(mode="json", exclude={"record_id"}, exclude_unset=True)
    return record.model_copy(update={"record_id": compute_record_id(content)})


def _eval_results(summary: dict) -> dict[str, EvalResult]:
    return {name: EvalResult.model_validate(result) for name, result in summary.items()}


def write_record(path: Path, record: ResultRecord) -> None:
    """record.json: the fields the run set (a claim's unused optional keys stay out, as its id
    was computed without them)."""
    content = record.model_dump(mode="json", exclude_unset=True)
    text = json.dumps(content, indent=2, sort_keys=True) + "\n"
    atomic_write_text(path, text)


def compute_info(
    steps: list[dict],
    world_size: int,
    device: str,
    model,
    parallel_clients: int,
    compile_backend: str | None,
    wall: float,
) -> Compute:
    """Wall time, hardware, realized cohorts and paper 004's CFMQ cost of a run's `steps` (its
    metrics lines of central steps)."""
    cuda = device.startswith("cuda")
    clients = sum(x["clients"] for x in steps)
    rounds = len(steps)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    payload = 2.0 * model_bytes  # download the model, upload a delta (paper 004's P ≈ 2×size)
    mean_local_steps = sum(x["local_steps"] for x in steps) / clients if clients else 0.0
    peak = float(torch.cuda.max_memory_allocated(device)) if cuda else None
    alpha = 1.0
    value = None
    if peak is not None:
        value = rounds * (clients / max(rounds, 1)) * (payload + alpha * mean_local_steps * peak)
    return Compute(
        wall_seconds=wall,
        device="cuda" if cuda else "cpu",
        device_name=device_name(device),
        num_processes=world_size,
        intra_op_threads=None if cuda else torch.get_num_threads(),
        parallel_clients=parallel_clients,
        compile_backend=compile_backend,
        gpu_hours=wall * world_size / 3600 if cuda else 0.0,
        central_steps=rounds,
        cohort_per_step=[x["clients"] for x in steps],
        cfmq={
            "rounds": rounds,
            "clients_per_round": clients / max(rounds, 1),
            "payload_bytes": payload,
            "mean_local_steps": mean_local_steps,
            "peak_client_memory_bytes": peak,
            "alpha": alpha,
            "value": value,
        },
        cpu=cpu_info(),
    )


def cpu_info() -> CpuKernels:
    """This CPU and the kernels torch picks on it (what compute.cpu states)."""
    return CpuKernels.model_validate(cpu_kernels())


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's: a record's numbers are reproduced bit for bit on the same."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def software_info() -> Software:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(__file__).resolve().parent,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return Software(
        pflbench_version=__version__,
        git_commit=commit,
        torch_version=torch.__version__,
        python_version=sys.version.split()[0],
        platform=platform.platform(),
        packages=package_versions(),
        numerics_version=NUMERICS_VERSION,
        plugins=[PluginInfo(**plugin.record()) for plugin in loaded_plugins()] or None,
    )


def data_info(data, seed_path: Path | None) -> DataInfo:
    """Digests of every data set and of the starting weights, and what preparation skipped."""
    stores = {"federated_train": data.federated_train, "seed_train": data.seed_train}
    stores = {name: store for name, store in stores.items() if store is not None}
    stores.update(data.eval_sets)
    digests = {name: store.digest for name, store in stores.items()}
    if seed_path is not None:  # the starting weights: runs are comparable only from the same ones
        digests["seed_model"] = tensors_digest(seed_path)
    skipped = {split: stats.get("skipped", {}) for split, stats in data.report.items()}
    sources = {
        split: {k: stats[k] for k in ("read_from", "speaker_groups_unavailable") if k in stats}
        for split, stats in data.report.items()
    }
    return DataInfo(
        digests=digests,
        audio_digests={name: store.audio_digest for name, store in stores.items()},
        skipped=skipped,
        sources=sources,
    )
