"""`pflbench results export --parquet FILE`: one row per record, flat columns, for pandas users."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pflbench.privacy.accountants import ACCOUNTANTS
from pflbench.results.leaderboard import central_steps, clip_bound, cohort_size
from pflbench.results.schema import ResultRecord


def epsilon_columns(record: ResultRecord) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for scale in ("simulated", "extrapolated"):
        claim = getattr(record.privacy, scale, None) if record.privacy else None
        for accountant in ACCOUNTANTS:
            item = claim.epsilon.get(accountant) if claim else None
            out[f"epsilon_{scale}_{accountant}"] = item.epsilon if item else None
    return out


def record_row(record: ResultRecord) -> dict:
    provenance = record.provenance
    privacy = record.privacy
    cfmq = record.compute.cfmq
    row = {
        "record_id": record.record_id,
        "kind": record.kind,
        "created": record.created,
        "task": record.task.name,
        "task_version": record.task.version,
        "baseline": record.baseline,
        "budget": record.budget,
        "seed": record.seed,
        "config_hash": record.config_hash,
        "dp": bool(privacy and privacy.dp),
        "sigma_dp": privacy.sigma_dp if privacy else None,
        "clip_bound": clip_bound(record),
        "cohort": None if cohort_size(record) is None else float(cohort_size(record)),
        "central_steps": central_steps(record),
        **epsilon_columns(record),
        "gpu_hours": record.compute.gpu_hours,
        "wall_seconds": record.compute.wall_seconds,
        "cfmq": cfmq.value if cfmq else None,
        "provenance": (
            f"{provenance.paper}, {provenance.table}: {provenance.row}" if provenance else None
        ),
        "record_json": json.dumps(record.model_dump(mode="json"), sort_keys=True),
    }
    for name, result in sorted(record.metrics.final.items()):
        row[f"wer.{name}"] = result.wer
        row[f"cer.{name}"] = result.cer
    return row


def export_parquet(records: list[ResultRecord], path: Path) -> int:
    """Write the records to a Parquet file; returns the number of rows."""
    rows = [record_row(r) for r in sorted(records, key=lambda r: r.record_id)]
    columns = list(dict.fromkeys(key for row in rows for key in row))  # union, first-seen order
    table = pa.table({c: [row.get(c) for row in rows] for c in columns})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return table.num_rows
