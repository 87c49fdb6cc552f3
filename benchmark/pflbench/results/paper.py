"""The papers' results as reference rows: results/paper/tables.yaml → results/paper/<id>.json.

tables.yaml transcribes every table of the papers pflbench builds on (cited by number, 001-004,
as in README.md). Per table it states how many configurations the table prints (counted by hand)
and lists each of them once, as one of

- a reference row: the pflbench task, baseline and budget that run the configuration, the --set
  overrides that a run adds, and the WERs exactly as printed (%, the \\numprint value where the
  paper's source has one);
- `same_as` the id of another table's reference row, where the paper prints the result again
  (its WERs are checked against that row's, within SAME_AS_TOLERANCE);
- `not_mapped` with the reason no pflbench task or baseline runs it.

A DP row names its σ_DP; its ε claims are the table's `noise` lines: the one at the row's own
scale (S, K) and, where the table extrapolates, the one the row's `extrapolated` scale names.
Rows at a σ_DP that no registry budget has are filed under the budget name `paper-sigma<σ_DP>`.

`pflbench results paper` writes one record per reference row; `--check` and the tests fail when a
record is missing, extra or differs from what the map says, or a table's rows do not add up to
its count, so no row of a paper is dropped silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from pflbench.errors import UserError
from pflbench.results.schema import (
    RECORD_SCHEMA_VERSION,
    Strict,
    compute_record_id,
    parse_record,
)
from pflbench.spec.names import NAME_PATTERN
from pflbench.spec.registry import Registry, read_yaml, validate
from pflbench.spec.resolve import resolve

PAPER_DIR = "paper"
TABLES_FILE = "tables.yaml"
SAME_AS_TOLERANCE = 0.05  # WER points: the paper reprints a few numbers with another 2nd decimal
NOISE_BUDGET_PREFIX = "paper-sigma"  # the budget of a row at a σ_DP no registry budget has
PAPER_EPSILON = {
    "accountant": "rdp",
    "library": "moments accountant (Abadi et al. 2016) as reported by the paper",
    "library_version": "paper",
    "details": "the paper's claim, copied, not recomputed",
}


def noise_budget_name(sigma_dp: float) -> str:
    """`paper-sigma3e-6` for σ_DP = 3e-6: the budget name of reference rows at that noise."""
    mantissa, exponent = f"{sigma_dp:e}".split("e")
    return f"{NOISE_BUDGET_PREFIX}{float(mantissa):g}e{int(exponent)}"


# ----------------------------------------------------------------------------------------------
# The map


class NoiseLine(Strict):
    """One (σ_DP, C, S, K, q, T, z, ε, order) line of a DP table, as printed (ε by the moments
    accountant at δ = the map's delta); z, q, ε and order are absent where the table omits them."""

    sigma_dp: float = Field(gt=0)
    clip_bound: float = Field(gt=0)
    cohort: int = Field(ge=1)
    population: int = Field(ge=1)
    steps: int = Field(ge=1)
    q: float | None = Field(None, gt=0)
    z: float | None = Field(None, gt=0)
    epsilon: float | None = Field(None, gt=0)
    order: float | None = Field(None, gt=1)


class Scale(Strict):
    population: int = Field(ge=1)
    cohort: int = Field(ge=1)
    steps: int = Field(ge=1)


class Entry(Strict):
    """One configuration a table prints: a reference row, `same_as` another, or `not_mapped`."""

    row: str
    column: str = ""
    id: str | None = Field(None, pattern=NAME_PATTERN, description="The record's file name.")
    task: str | None = None
    baseline: str | None = None
    budget: str | None = Field(None, pattern=NAME_PATTERN)
    set: dict[str, str] = Field(default_factory=dict, description="--set key.path=value")
    sigma_dp: float | None = Field(None, gt=0)
    extrapolated: Scale | None = None
    wer: dict[str, float] = Field(default_factory=dict, description="WER in %, as printed.")
    gpu_hours: float | None = Field(None, ge=0)
    note: str = ""
    same_as: str | None = None
    not_mapped: str | None = None

    @property
    def kind(self) -> str:
        if self.not_mapped is not None:
            return "not mapped"
        return "same as" if self.same_as is not None else "reference"

    @model_validator(mode="after")
    def _one_kind(self) -> Entry:
        mapping = ("id", "task", "baseline", "budget", "sigma_dp", "extrapolated", "gpu_hours")
        given = [name for name in (*mapping, "set") if getattr(self, name)]
        if self.not_mapped is not None or self.same_as is not None:
            extra = given + (["wer"] if self.not_mapped is not None and self.wer else [])
            if (self.not_mapped is not None and self.same_as is not None) or extra:
                raise ValueError(
                    f"row {self.row!r}: a {self.kind} row takes no {', '.join(extra) or 'same_as'}"
                )
            if self.same_as is not None and not self.wer:
                raise ValueError(f"row {self.row!r}: a same_as row needs the WERs as printed")
            return self
        missing = [name for name in ("id", "task", "baseline", "budget") if not getattr(self, name)]
        if missing or not self.wer:
            raise ValueError(
                f"row {self.row!r}: a reference row needs {', '.join(missing or ['wer'])}"
                " (or same_as / not_mapped)"
            )
        return self


class PaperTable(Strict):
    paper: str
    table: str
    title: str
    entries: int = Field(ge=0, description="Configurations the table prints, counted by hand.")
    other: str = Field("", description="What else the table prints, and why it is no entry.")
    not_mapped: str | None = Field(None, description="Why no configuration of it maps at all.")
    noise: list[NoiseLine] = Field(default_factory=list)
    rows: list[Entry] = Field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.paper} {self.table}"

    @model_validator(mode="after")
    def _rows_add_up(self) -> PaperTable:
        if self.not_mapped is not None:
            if self.rows:
                raise ValueError(f"{self.name}: a table not mapped as a whole lists no rows")
        elif len(self.rows) != self.entries:
            raise ValueError(
                f"{self.name}: {len(self.rows)} rows transcribed, but the table prints "
                f"{self.entries} configurations"
            )
        return self


class PaperMap(Strict):
    created: str = Field(description="The records' `created` time (when the rows were entered).")
    delta: float = Field(gt=0, lt=1, description="δ of every ε the papers print.")
    papers: dict[str, str] = Field(description="Number -> citation.")
    populations: dict[str, int] = Field(description="K: users of each task's federated data.")
    tables: list[PaperTable]


def load_paper_map(path: Path) -> PaperMap:
    data, _ = read_yaml(Path(path))
    return validate(PaperMap, data, str(path))


# ----------------------------------------------------------------------------------------------
# Checking the map against the registry and building the records


@dataclass
class Built:
    """The records a map gives: file name -> record JSON, and per table the counts by kind."""

    records: dict[str, dict] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)


def build_reference_records(pmap: PaperMap, registry: Registry, where: str) -> Built:
    """Every reference row of the map as a validated record; UserError naming the table and row
    for anything that does not check out (unknown names, overrides that do not resolve, eval
    sets the task lacks, a same_as whose numbers differ, a DP row without its noise line)."""
    mapped = _mapped_entries(pmap, where)
    also: dict[str, list[dict]] = {}
    built = Built()
    for table in pmap.tables:
        counts = {"reference": 0, "same as": 0, "not mapped": 0}
        if table.not_mapped is not None:
            counts["not mapped"] = table.entries
        for entry in table.rows:
            counts[entry.kind] += 1
            if entry.same_as is not None:
                _check_same_as(entry, table, mapped, where)
                also.setdefault(entry.same_as, []).append(_citation(table, entry))
        built.counts[table.name] = counts
    for table in pmap.tables:
        for entry in table.rows:
            if entry.kind == "reference":
                record = _record(entry, table, pmap, registry, also.get(entry.id, []), where)
                built.records[f"{entry.id}.json"] = record
    return built


def _mapped_entries(pmap: PaperMap, where: str) -> dict[str, tuple[PaperTable, Entry]]:
    found: dict[str, tuple[PaperTable, Entry]] = {}
    for table in pmap.tables:
        for entry in table.rows:
            if entry.id is None:
                continue
            if entry.id in found:
                raise UserError(f"{where}: {table.name}: id {entry.id!r} is used twice")
            found[entry.id] = (table, entry)
    return found


def _check_same_as(entry: Entry, table: PaperTable, mapped: dict, where: str) -> None:
    here = f"{where}: {table.name}, row {entry.row!r} {entry.column!r}"
    if entry.same_as not in mapped:
        raise UserError(f"{here}: same_as {entry.same_as!r} is no reference row's id")
    target = mapped[entry.same_as][1]
    for name, value in entry.wer.items():
        if name not in target.wer:
            raise UserError(f"{here}: {name} is not in {entry.same_as}'s WERs")
        if abs(value - target.wer[name]) > SAME_AS_TOLERANCE + 1e-9:
            raise UserError(
                f"{here}: {name} WER {value} differs from {entry.same_as}'s {target.wer[name]} "
                f"by more than {SAME_AS_TOLERANCE} points: not the same result"
            )


def _citation(table: PaperTable, entry: Entry) -> dict:
    return {"paper": table.paper, "table": table.table, "row": entry.row, "column": entry.column}


def _record(
    entry: Entry, table: PaperTable, pmap: PaperMap, registry: Registry, also: list, where: str
) -> dict:
    here = f"{where}: {table.name}, row {entry.row!r} {entry.column!r}"
    for kind, name, known in (
        ("task", entry.task, registry.tasks),
        ("baseline", entry.baseline, registry.baselines),
    ):
        if name not in known:
            raise UserError(f"{here}: unknown {kind} {name!r}")
    task = registry.tasks[entry.task].spec
    sets = [f"{key}={value}" for key, value in entry.set.items()]
    try:
        recipe = resolve(registry, entry.task, entry.baseline, "none", 0, sets).recipe
    except UserError as exc:
        raise UserError(f"{here}: its configuration does not resolve: {exc}") from None
    roles = {e.name: e.role for e in task.eval_sets}
    unknown = sorted(set(entry.wer) - set(roles))
    if unknown or "test" not in {roles[name] for name in entry.wer}:
        raise UserError(
            f"{here}: WERs must name eval sets of {entry.task} ({', '.join(roles)}) including a "
            f"test set; got {', '.join(entry.wer)}"
        )
    if entry.task not in pmap.populations:
        raise UserError(f"{here}: no population K for task {entry.task!r} in `populations`")
    dp = _budget_is_dp(entry, registry, here)
    record = {
        "schema_version": RECORD_SCHEMA_VERSION,
        "created": pmap.created,
        "kind": "reference",
        "provenance": {
            **_citation(table, entry),
            "note": entry.note,
            "overrides": dict(entry.set),
            "also": also,
        },
        "task": {"name": entry.task, "version": task.version},
        "baseline": entry.baseline,
        "budget": entry.budget,
        "seed": None,
        "config_hash": None,
        "config": None,
        "metrics": {
            "final": {
                name: {"role": roles[name], "wer": round(value / 100, 10)}
                for name, value in entry.wer.items()
            },
            "history": [],
        },
        "privacy": _privacy(entry, table, pmap, recipe, dp, here),
        "compute": _compute(entry, recipe),
        "software": None,
        "data": None,
        "diagnostics": None,
    }
    record["record_id"] = compute_record_id(record)
    parse_record(record, here)
    return record


def _budget_is_dp(entry: Entry, registry: Registry, here: str) -> bool:
    if entry.budget in registry.budgets:
        dp = registry.budgets[entry.budget].spec.dp
    elif entry.budget.startswith(NOISE_BUDGET_PREFIX):
        dp = True
        if entry.sigma_dp is not None and entry.budget != noise_budget_name(entry.sigma_dp):
            raise UserError(
                f"{here}: budget {entry.budget!r} does not name its σ_DP "
                f"({noise_budget_name(entry.sigma_dp)})"
            )
    else:
        raise UserError(
            f"{here}: budget {entry.budget!r} is neither a registry budget nor "
            f"{NOISE_BUDGET_PREFIX}<σ_DP>"
        )
    if dp != (entry.sigma_dp is not None):
        raise UserError(f"{here}: a row under a DP budget states its sigma_dp, others do not")
    return dp


def _privacy(entry: Entry, table: PaperTable, pmap: PaperMap, recipe, dp: bool, here: str):
    if recipe.training != "federated":
        return None
    population = pmap.populations[entry.task]
    cohort, steps = recipe.federated.cohort_size, recipe.federated.central_steps
    clip = None if recipe.privacy.clipping == "none" else recipe.privacy.clip_bound
    common = {"sampling": "poisson", "clip_bound": clip}
    if not dp:
        return {
            **common,
            "dp": False,
            "mechanism": "none",
            "sigma_dp": 0.0,
            "simulated": {
                "population": population,
                "cohort": cohort,
                "steps": steps,
                "sampling_rate": round(cohort / population, 6),
                "noise_multiplier": 0.0,
                "epsilon": {},
            },
            "how": "The paper's claim (no DP noise, ε = ∞), copied from the paper.",
        }
    own = _noise_line(table, entry.sigma_dp, Scale(population=population, cohort=cohort, steps=1))
    if own is None:
        raise UserError(
            f"{here}: {table.name} has no noise line for σ_DP = {entry.sigma_dp:g} at "
            f"S = {cohort}, K = {population}"
        )
    extrapolated = None
    if entry.extrapolated is not None:
        extrapolated = _noise_line(table, entry.sigma_dp, entry.extrapolated, steps=True)
        if extrapolated is None:
            raise UserError(f"{here}: {table.name} has no noise line at {entry.extrapolated}")
    claims = [line.epsilon for line in (own, extrapolated) if line is not None]
    how = (
        f"The paper's claim ({table.name}, moments accountant, δ = {pmap.delta:g}), copied from "
        "the paper"
        + ("; extrapolated following McMahan et al. 2018 assuming the WER stays the same." if
           extrapolated else ".")
        if all(claims)
        else f"{table.name} prints no ε for this configuration; σ_DP, C, S, K and T are its."
    )  # fmt: skip
    return {
        **common,
        "dp": True,
        "mechanism": "gaussian",
        "sigma_dp": entry.sigma_dp,
        "simulated": _scale_claim(own, pmap.delta),
        "extrapolated": None if extrapolated is None else _scale_claim(extrapolated, pmap.delta),
        "how": how,
    }


def _noise_line(table: PaperTable, sigma: float, scale: Scale, steps: bool = False):
    for line in table.noise:
        if (
            abs(line.sigma_dp / sigma - 1) < 1e-9
            and (line.population, line.cohort) == (scale.population, scale.cohort)
            and (not steps or line.steps == scale.steps)
        ):
            return line
    return None


def _scale_claim(line: NoiseLine, delta: float) -> dict:
    z = line.z if line.z is not None else round(line.sigma_dp * line.cohort, 12)
    q = line.q if line.q is not None else round(line.cohort / line.population, 6)
    epsilon: dict[str, Any] = {}
    if line.epsilon is not None:
        epsilon["rdp"] = {
            **PAPER_EPSILON,
            "epsilon": line.epsilon,
            "delta": delta,
            "noise_multiplier": z,
            "sampling_rate": q,
            "steps": line.steps,
            "order": line.order,
        }
    return {
        "population": line.population,
        "cohort": line.cohort,
        "steps": line.steps,
        "sampling_rate": q,
        "noise_multiplier": z,
        "epsilon": epsilon,
    }


def _compute(entry: Entry, recipe) -> dict:
    federated = recipe.training == "federated"
    steps = {"federated": recipe.federated.central_steps, "seed-only": 0}.get(recipe.training)
    return {
        "central_steps": steps,
        "cfmq": (
            {"rounds": steps, "clients_per_round": recipe.federated.cohort_size}
            if federated
            else None
        ),
        "gpu_hours": entry.gpu_hours,
        "device": None,
        "device_name": None,
        "num_processes": None,
        "wall_seconds": None,
    }


# ----------------------------------------------------------------------------------------------
# The files


def record_text(record: dict) -> str:
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


@dataclass
class PaperSync:
    written: list[Path] = field(default_factory=list)
    differing: list[Path] = field(default_factory=list)  # missing or not what the map gives
    extra: list[Path] = field(default_factory=list)  # JSON in results/paper/ the map does not give
    built: Built = field(default_factory=Built)


def sync_paper_records(results: Path, registry: Registry, write: bool) -> PaperSync:
    """Compare results/paper/*.json with what tables.yaml gives; with `write`, (re)write the
    differing ones. Extra files are reported, never deleted."""
    folder = Path(results) / PAPER_DIR
    map_path = folder / TABLES_FILE
    if not map_path.is_file():
        raise UserError(f"{map_path}: no such file (the transcription of the papers' tables)")
    built = build_reference_records(load_paper_map(map_path), registry, str(map_path))
    sync = PaperSync(built=built)
    for name, record in sorted(built.records.items()):
        path, text = folder / name, record_text(record)
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        sync.differing.append(path)
        if write:
            path.write_text(text, encoding="utf-8")
            sync.written.append(path)
    sync.extra = sorted(p for p in folder.glob("*.json") if p.name not in built.records)
    return sync


def check_paper_records(results: Path, registry: Registry) -> None:
    """results/paper/ holds exactly the reference records tables.yaml gives (`results validate`)."""
    sync = sync_paper_records(results, registry, write=False)
    if sync.extra:
        raise UserError(
            f"{sync.extra[0]}: a reference record results/paper/tables.yaml does not give"
            f" ({len(sync.extra)} such): add its row to the map, or remove it"
        )
    if sync.differing:
        wrong = sync.differing[0]
        what = "not the reference record" if wrong.is_file() else "missing: the record"
        raise UserError(
            f"{wrong}: {what} results/paper/tables.yaml gives ({len(sync.differing)}"
            " such); `pflbench results paper` writes them from the map"
        )
