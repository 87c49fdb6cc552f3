"""`pflbench bench results`: leaderboard regeneration over 10,000 synthetic records (< 5 s)."""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from pflbench.numerics import NUMERICS_VERSION
from pflbench.results.leaderboard import load_results, render_leaderboard
from pflbench.results.schema import (
    RECORD_SCHEMA_VERSION,
    ResultRecord,
    compute_record_id,
)
from pflbench.results.submit import record_path
from pflbench.spec.models import Baseline, Budget, DataSource, EvalSet, Recipe, RunConfig, Task
from pflbench.spec.resolve import config_json_hash

TARGET_SECONDS = 5.0


def synthetic_config(
    task: str,
    baseline: str,
    budget: Budget,
    seed: int,
    cohort: int,
    eval_sets: dict[str, str] | None = None,
    version: int = 1,
) -> dict:
    """A complete resolved RunConfig (as JSON) for a made-up task, as a run would store it.
    `eval_sets` maps eval set name → role (default: dev and test)."""
    sets = eval_sets or {"dev": "dev", "test": "test"}
    spec = Task(
        name=task,
        version=version,
        language="en",
        description="synthetic records for benchmarks and tests",
        federated_data=DataSource(corpus="commonvoice", subsets=["train"], locale="en"),
        eval_sets=[
            EvalSet(name=name, corpus="commonvoice", subset=role, locale="en", role=role)
            for name, role in sets.items()
        ],
    )
    recipe = Recipe().model_dump()
    recipe["federated"]["cohort_size"] = cohort
    config = RunConfig(
        task=spec,
        baseline=Baseline(name=baseline, description="synthetic", reproduces="none"),
        budget=budget,
        seed=seed,
        recipe=Recipe.model_validate(recipe),
    )
    return config.model_dump(mode="json")


def synthetic_record(
    config: dict, wers: dict[str, float], created: str, privacy: dict | None = None
) -> dict:
    """A run record around `config` with made-up WERs per eval set (as fractions)."""
    roles = {item["name"]: item["role"] for item in config["task"]["eval_sets"]}
    record = {
        "schema_version": RECORD_SCHEMA_VERSION,
        "created": created,
        "kind": "run",
        "provenance": None,
        "task": {"name": config["task"]["name"], "version": config["task"]["version"]},
        "baseline": config["baseline"]["name"],
        "budget": config["budget"]["name"],
        "seed": config["seed"],
        "config_hash": config_json_hash(config),
        "config": config,
        "metrics": {
            "final": {name: {"role": roles[name], "wer": wer} for name, wer in wers.items()},
            "seed_model": None,
            "history": [],
        },
        "privacy": privacy,
        "compute": {
            "wall_seconds": 60.0,
            "device": "cpu",
            "device_name": "synthetic",
            "num_processes": 1,
            "gpu_hours": 0.0,
            "central_steps": config["recipe"]["federated"]["central_steps"],
            "cfmq": None,
        },
        "software": {
            "pflbench_version": "0",
            "git_commit": None,
            "torch_version": "0",
            "python_version": "3",
            "platform": "synthetic",
            "numerics_version": NUMERICS_VERSION,
        },
        "data": {"digests": {}, "skipped": {}},
        "diagnostics": {"nonfinite_updates": 0, "clipped_fraction_mean": None},
    }
    record["record_id"] = compute_record_id(record)
    return record


def write_synthetic_results(root: Path, count: int, seed: int = 0) -> None:
    """`count` records over 10 tasks × 10 baselines × seeds, filed as submit would file them."""
    rng = random.Random(seed)
    budget = Budget(name="none", dp=False)
    for i in range(count):
        task, baseline = f"bench-task-{i % 10}", f"baseline-{(i // 10) % 10}"
        config = synthetic_config(task, baseline, budget, seed=i // 100, cohort=8 << (i % 3))
        wers = {"dev": rng.random(), "test": rng.random()}
        record = synthetic_record(config, wers, "2026-01-01T00:00:00+00:00")
        path = record_path(root, ResultRecord.model_validate(record))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))


def bench_results(count: int = 10_000) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "results"
        write_synthetic_results(root, count)
        start = time.perf_counter()
        records = load_results(root)
        loaded = time.perf_counter()
        text = render_leaderboard(records)
        done = time.perf_counter()
    return {
        "records": len(records),
        "load_seconds": loaded - start,
        "render_seconds": done - loaded,
        "total_seconds": done - start,
        "target_seconds": TARGET_SECONDS,
        "leaderboard_bytes": len(text.encode()),
    }
