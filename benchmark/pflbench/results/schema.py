"""The result record: one finished run (or one row copied from a paper) as versioned JSON.

A record is plain data. It is read with `json` and validated with pydantic; nothing in it is ever
executed, unpickled or used as a file path without `safe_name`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pflbench.errors import UserError
from pflbench.numerics import current_numerics
from pflbench.spec.names import NAME_PATTERN
from pflbench.spec.registry import format_validation_error
from pflbench.spec.resolve import canonical_json, ran_hash

RECORD_SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 2 * 1024 * 1024  # a record is a few KiB; anything this large is not one
RECORD_ID_PATTERN = r"^[0-9a-f]{16}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"


Count = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """Privacy claims come from pflbench.privacy verbatim: extra keys there are kept."""

    model_config = ConfigDict(extra="allow")


class Citation(Strict):
    """Where a paper prints a result: paper ("002", as docs cite the papers), table, row, column."""

    paper: str
    table: str
    row: str
    column: str = ""


class Provenance(Citation):
    note: str = ""
    overrides: dict[str, str] = Field(
        default_factory=dict,
        description="The --set overrides (key.path -> value as typed) that a pflbench run of the"
        " paper's configuration adds to the record's task and baseline.",
    )
    also: list[Citation] = Field(
        default_factory=list, description="Other tables that print the same result."
    )


class TaskRef(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    version: int = Field(ge=1)


class GroupResult(Strict):
    errors: Count
    words: Count
    speakers: Count
    wer: float | None = Field(None, ge=0, description="errors / words; null without words.")


class EvalResult(Strict):
    role: Literal["dev", "test"]
    wer: float = Field(ge=0, description="Word error rate as a fraction (0.2 = 20%).")
    cer: float | None = Field(None, ge=0)
    speaker_wer_mean: float | None = Field(None, ge=0)
    speaker_wer_p10: float | None = Field(None, ge=0, description="10th percentile speaker WER.")
    speaker_wer_p50: float | None = Field(None, ge=0, description="Median speaker WER.")
    speaker_wer_p90: float | None = Field(None, ge=0, description="90th percentile speaker WER.")
    num_utterances: int | None = Field(None, ge=0)
    speakers: dict[str, tuple[Count, Count]] | None = Field(
        None,
        description="Per speaker (word errors, reference words): what a speaker-level bootstrap "
        "of the WER resamples (pflbench.results.stats).",
    )
    groups: dict[str, dict[str, GroupResult]] | None = Field(
        None,
        description="Per speaker attribute (age, gender, accent, as the corpus reports them) and "
        "group: the pooled WER over the group's speakers.",
    )

    @model_validator(mode="after")
    def _groups_partition_the_speakers(self) -> EvalResult:
        """Each attribute's groups must add up to the speakers' counts (a tampered group is
        caught here, since group WERs feed the leaderboard's worst-group column)."""
        if not self.groups or not self.speakers:
            return self
        totals = (
            sum(e for e, _ in self.speakers.values()),
            sum(n for _, n in self.speakers.values()),
            len(self.speakers),
        )
        for attribute, groups in self.groups.items():
            summed = tuple(
                sum(getattr(g, f) for g in groups.values()) for f in ("errors", "words", "speakers")
            )
            if summed != totals:
                raise ValueError(
                    f"groups[{attribute!r}] add up to (errors, words, speakers) {summed}, "
                    f"but the speakers to {totals}"
                )
            for name, g in groups.items():
                if g.words and (g.wer is None or abs(g.wer - g.errors / g.words) > 1e-9):
                    raise ValueError(f"groups[{attribute!r}][{name!r}].wer is not errors / words")
        return self


class HistoryPoint(Strict):
    step: int = Field(ge=0)
    eval_set: str
    wer: float = Field(ge=0)
    cer: float | None = Field(None, ge=0)


class Metrics(Strict):
    final: dict[str, EvalResult] = Field(min_length=1)
    seed_model: dict[str, EvalResult] | None = None
    history: list[HistoryPoint] = Field(default_factory=list)


class EpsilonClaim(Open):
    """One accountant's ε; `epsilon` is null with an `error` where the accountant cannot compute
    it (e.g. PLD at an astronomically large ε)."""

    accountant: str = Field(description="A registered accountant (pflbench.privacy.accountants).")
    library: str | None = None
    library_version: str | None = None
    epsilon: float | None = Field(None, ge=0)
    delta: float | None = None
    noise_multiplier: float | None = None
    sampling_rate: float | None = None
    steps: int | None = None
    order: float | None = None
    details: Any = None
    error: str | None = None


class ScaleClaim(Open):
    population: int = Field(ge=1)
    cohort: int = Field(ge=1)
    steps: int = Field(ge=0)
    sampling_rate: float
    noise_multiplier: float
    epsilon: dict[str, EpsilonClaim | None] = Field(
        description="By accountant name; null without noise (ε is infinite)."
    )


class AuditCosines(Strict):
    inserted_mean: float
    inserted_std: float
    held_out_mean: float
    held_out_std: float


class CanaryCosines(Strict):
    inserted: list[float]
    held_out: list[float]


class PrivacyAudit(Strict):
    """What pflbench.privacy.audit.CanaryAudit.finish returns: the empirical ε of an audit run,
    next to the accountants' ε at the simulated scale (the only one an audit can check)."""

    method: str
    canaries_inserted: int = Field(ge=1)
    canaries_held_out: int = Field(ge=1)
    canaries_sampled: int = Field(ge=0, description="Inserted canaries sampled at least once.")
    canary_participations: int = Field(ge=0)
    dimension: int = Field(ge=1, description="Trained parameters the canaries span.")
    cosines: AuditCosines
    canary_cosines: CanaryCosines | None = Field(
        None,
        description="Each canary's cosine: what `cosines`, μ and the lower bound are computed"
        " from, so submit and validate recompute them. Absent in older records.",
    )
    delta: float = Field(gt=0, lt=1)
    mu: float = Field(ge=0, description="μ-GDP estimate; inf when the cosines never overlap.")
    epsilon_estimate: float = Field(ge=0)
    epsilon_lower_bound: float = Field(ge=0)
    confidence: float = Field(gt=0, lt=1)
    lower_bound_method: str
    accountant_epsilon_simulated: dict[str, float | None] = Field(
        description="By accountant; null without noise (ε is infinite) or where it fails."
    )
    how: str


class PrivacyClaim(Open):
    """What pflbench.privacy.statement.privacy_statement returns (docs/RESULTS.md describes it)."""

    dp: bool
    mechanism: str | None = None
    unit: Literal["user", "pseudo-user", "example"] | None = Field(
        None,
        description="What one DP neighbour adds or removes: a user (speaker), on -iid tasks a"
        " pseudo-user (a random group of utterances), or for example-level DP-SGD (training:"
        " dpsgd-example) one example (an utterance): an example-level ε is not comparable with a"
        " user-level one. Absent in older records: user.",
    )
    sigma_dp: float | None = Field(None, ge=0)
    clip_bound: float | None = Field(None, gt=0)
    sampling: Literal["poisson", "fixed"] | None = None
    claimed_by: str | None = Field(
        None,
        description="The accountant whose ε is claimed against the budget (the budget's"
        " accountant); the other accountants' ε are cross-checks. Absent in older records: rdp.",
    )
    simulated: ScaleClaim | None = None
    extrapolated: ScaleClaim | None = None
    how: str | None = None
    payload: str | None = Field(
        None,
        description="What a client algorithm sends beside its update, and how the clipping and"
        " noise cover it (absent: the update alone).",
    )
    audit: PrivacyAudit | None = None


class Cfmq(Strict):
    """Paper 004's cost: CFMQ = R·K·(P + α·μ·ν)."""

    rounds: int | None = None
    clients_per_round: float | None = None
    payload_bytes: float | None = None
    mean_local_steps: float | None = None
    peak_client_memory_bytes: float | None = None
    alpha: float | None = None
    value: float | None = None


class CpuKernels(Strict):
    """The CPU a run ran on and the kernels torch picked there (pflbench.numerics.cpu_kernels):
    CPU float results (features always; training on --device cpu) depend on them."""

    model: str | None = None
    vendor: str | None = None
    isa: list[str] = Field(
        default_factory=list, description="The CPU's flags among those that pick kernels."
    )
    aten_capability: str | None = Field(
        None, description="torch's vectorized kernels (DEFAULT, AVX2, AVX512; ATEN_CPU_CAPABILITY)."
    )
    mkl_cbwr: str | None = Field(
        None, description="MKL_CBWR (MKL's reproducibility branch); null: MKL picks by CPU."
    )
    onednn_enabled: bool | None = None
    onednn_max_cpu_isa: str | None = Field(None, description="ONEDNN_MAX_CPU_ISA; null: unset.")
    float32_matmul_precision: str | None = None


class Compute(Strict):
    """Optional fields are unknown for reference rows (a paper rarely reports them)."""

    wall_seconds: float | None = Field(
        None,
        ge=0,
        description="The run's wall time over all its processes: a resumed run adds the earlier"
        " processes' time up to the checkpoint it resumed from (records before 2026-11-25: the"
        " last process only).",
    )
    device: str | None = None
    device_name: str | None = None
    num_processes: int | None = Field(None, ge=1)
    intra_op_threads: int | None = Field(
        None,
        description="torch's CPU threads per process: float sums, hence the numbers, depend on "
        "it; a CPU run is bitwise reproducible with the same torch build, CPU and thread count.",
    )
    parallel_clients: int | None = None  # clients trained at once per process (fl.parallel)
    compile_backend: str | None = Field(
        None,
        description="The torch.compile backend of the clients' local step (`run --compile`: "
        "inductor); null: eager (absent: eager or an older record). Compiled kernels round "
        "differently, so a compiled run's numbers differ from the eager run's in float rounding.",
    )
    gpu_hours: float | None = Field(None, ge=0)
    central_steps: int | None = Field(None, ge=0)
    cohort_per_step: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="Users that took part in each central step (realized, not expected)."
    )
    cfmq: Cfmq | None = None
    cpu: CpuKernels | None = Field(None, description="Absent in older records.")


class PluginInfo(Strict):
    name: str
    version: str | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    source: str
    registered: dict[str, list[str]] = Field(default_factory=dict)


class Software(Strict):
    pflbench_version: str
    git_commit: str | None = None
    torch_version: str
    python_version: str
    platform: str
    packages: dict[str, str | None] | None = Field(
        None,
        description="Versions of the other packages and native libraries that can change a "
        "number (pflbench.numerics.package_versions; null: not installed). Absent in older "
        "records.",
    )
    numerics_version: int | None = Field(
        None,
        description="pflbench.numerics.NUMERICS_VERSION of the code that ran: bumped when the "
        "code changes the numbers a run produces. Absent in older records (version 1).",
    )
    plugins: list[PluginInfo] | None = Field(
        None,
        description="The plug-ins loaded in the run (pflbench.plugins): `pflbench submit` loads "
        "each with the same source sha256 or refuses the record. Absent: none.",
    )


class DataInfo(Strict):
    digests: dict[str, str] = Field(
        default_factory=dict,
        description="Per data set, the sha256 of what training or scoring reads (ids, users, "
        "texts, features, tokens; older records hashed the manifest with absolute paths), and "
        "`seed_model`, the sha256 of the starting weights' tensors.",
    )
    audio_digests: dict[str, str] | None = Field(
        None,
        description="Per data set, the sha256 of the decoded audio its features were computed "
        "from: where `digests` differ, tells another corpus from other feature arithmetic. "
        "Absent in older records.",
    )
    skipped: dict[str, Any] = Field(default_factory=dict)
    sources: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per split (as in `skipped`): `read_from`, where each subset was read (a "
        "Hugging Face dataset's config included), and `speaker_groups_unavailable`, why its "
        "speakers form no groups for per-group WER, where they form none.",
    )


class Outputs(Strict):
    """What the run produced that pflbench can check again (docs/RESULTS.md, "Verified rows")."""

    final_model: str = Field(
        pattern=SHA256_PATTERN,
        description="tensors_digest of checkpoints/final.safetensors: `pflbench verify` "
        "re-evaluates this very checkpoint.",
    )
    hypotheses: dict[str, Annotated[str, Field(pattern=SHA256_PATTERN)]] = Field(
        description="Per eval set: sha256 of hypotheses/<eval set>.jsonl.gz uncompressed, the "
        "final model's transcripts from which `pflbench submit` re-scores every WER/CER figure."
    )


class Diagnostics(Strict):
    """Computed from the raw client updates: not differentially private (as in metrics.jsonl)."""

    private: Literal[False] = False
    nonfinite_updates: int = Field(0, ge=0)
    clipped_fraction_mean: float | None = Field(None, ge=0, le=1)


class ResultRecord(Strict):
    """One result: a run of `pflbench run` ("run") or a row copied from a paper ("reference")."""

    schema_version: int
    record_id: str = Field(pattern=RECORD_ID_PATTERN)
    created: str = Field(description="ISO-8601 UTC time the record was written.")
    kind: Literal["run", "reference"]
    provenance: Provenance | None = None
    task: TaskRef
    baseline: str = Field(pattern=NAME_PATTERN)
    budget: str = Field(pattern=NAME_PATTERN)
    seed: int | None = None
    config_hash: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    config: dict[str, Any] | None = Field(None, description="The resolved RunConfig as JSON.")
    metrics: Metrics
    privacy: PrivacyClaim | None = None
    compute: Compute
    software: Software | None = None
    data: DataInfo | None = None
    diagnostics: Diagnostics | None = None
    outputs: Outputs | None = Field(
        None,
        description="Required in a run record (every WER/CER figure is re-scored from these "
        "hypotheses); absent in reference rows.",
    )

    @model_validator(mode="after")
    def _kind_fields(self) -> ResultRecord:
        try:
            created = datetime.fromisoformat(self.created)
        except ValueError:
            raise ValueError(f"created {self.created!r} is not an ISO-8601 time") from None
        if created.replace(tzinfo=created.tzinfo or UTC) > datetime.now(UTC) + timedelta(days=1):
            raise ValueError(f"created {self.created!r} is in the future")
        if self.kind == "reference" and self.provenance is None:
            raise ValueError("a reference record needs provenance (paper, table, row)")
        if self.kind == "run" and self.provenance is not None:
            raise ValueError(
                "a run record has no provenance (a paper citation is a reference row's)"
            )
        if self.kind == "run":
            needed = ("seed", "config_hash", "config", "software", "data", "diagnostics")
            missing = [name for name in needed if getattr(self, name) is None]
            if missing:
                raise ValueError(f"a run record needs {', '.join(missing)}")
            if self.outputs is None:
                raise ValueError(
                    "a run record needs outputs (its stored hypotheses): without them its WER "
                    "cannot be re-scored; records written before runs kept them must be run again"
                )
        return self


# ----------------------------------------------------------------------------------------------
# Helpers


def compute_record_id(record: dict) -> str:
    """First 16 hex of sha256 over the canonical JSON of the record without its record_id."""
    body = {key: value for key, value in record.items() if key != "record_id"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()[:16]


def _json_constant(value: str) -> float:
    # ε is infinite without noise, so Infinity is accepted; NaN is never a valid measurement.
    if value == "NaN":
        raise ValueError("NaN is not a valid value in a record")
    return float(value)


def _object_without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # json keeps the last of two equal keys; a reader of the file may believe the first.
    found = dict(pairs)
    if len(found) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {key!r}")
    return found


def read_json_file(path: Path) -> Any:
    """JSON from a file of at most MAX_RECORD_BYTES (a record, or a file filed beside one: its
    config, its verification stamp), NaN and duplicate keys refused."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: a folder, not a file")
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_RECORD_BYTES:
        raise UserError(
            f"{path}: {size} bytes is over the {MAX_RECORD_BYTES}-byte limit for a result file"
        )
    try:
        return json.loads(
            path.read_bytes(),
            parse_constant=_json_constant,
            object_pairs_hook=_object_without_duplicate_keys,
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON: {exc}") from None
    except RecursionError:  # (json's decoder recurses once per level)
        raise UserError(f"{path}: JSON nested too deeply to be a record") from None


def parse_record(data: Any, where: str) -> ResultRecord:
    """Validate a decoded record: known schema version, schema, and an id that matches its body."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a record is a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != RECORD_SCHEMA_VERSION:
        raise UserError(
            f"{where}: unknown record schema_version {version!r} "
            f"(this pflbench reads version {RECORD_SCHEMA_VERSION})"
        )
    try:
        record = ResultRecord.model_validate(data)
    except ValidationError as exc:
        raise UserError(
            format_validation_error(where, exc).replace("invalid spec", "invalid record")
        ) from None
    expected = compute_record_id(data)
    if record.record_id != expected:
        raise UserError(
            f"{where}: record_id {record.record_id} does not match its content ({expected}); "
            "the record was edited after it was written"
        )
    return record


def load_record(path: Path) -> tuple[ResultRecord, dict]:
    """(validated record, the raw dict it came from) from a JSON file."""
    data = read_json_file(path)
    return parse_record(data, str(path)), data


def schema_json() -> str:
    """The JSON Schema of ResultRecord as written to results/schema.json."""
    schema = ResultRecord.model_json_schema()
    schema["$id"] = f"pflbench-result-record-v{RECORD_SCHEMA_VERSION}"
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def record_numerics_version(record: ResultRecord) -> int:
    """The numerics version whose numbers a run's are: its code's (records from before it was
    stated: 1), or a later one no change since touches runs like it (numerics.current_numerics)."""
    dp = record.privacy is not None and record.privacy.dp
    return current_numerics(record.software.numerics_version or 1, dp)


# Recipe keys that configs once carried and that no longer exist (nothing ever read either):
# privacy.accountant (the accountant is the budget's alone) and federated.layer_freeze.warm_batches
# (layer freezing scores over the whole seed training).
RETIRED_RECIPE_KEYS = (("privacy", "accountant"), ("federated", "layer_freeze", "warm_batches"))


def _algorithm_run_before_it_was_named(client: dict) -> str | None:
    """The client algorithm a config from before `federated.client.algorithm` existed ran: the
    code then applied FedProx, variational noise and the data limit wherever their fields were
    set (fl/algorithms took them over bitwise); None for plain FedAvg (the default) and where more
    than one is set (no single algorithm today)."""
    noise = client.get("variational_noise") or {}
    active = [
        name
        for name, on in (
            ("fedprox", (client.get("fedprox_mu") or 0) > 0),
            ("fvn", (noise.get("std") or 0) > 0),
            ("data-limit", client.get("max_utterances") is not None),
        )
        if on
    ]
    return active[0] if len(active) == 1 else None


def current_config(stored: dict) -> dict:
    """A stored config in today's RunConfig shape: retired recipe keys are dropped from the run's
    recipe and the task's, and a client algorithm from before it was named is named (the hash is
    checked on the config as stored)."""
    config = copy.deepcopy(stored)
    for recipe in (config.get("recipe"), (config.get("task") or {}).get("recipe")):
        for *parents, key in RETIRED_RECIPE_KEYS:
            node = recipe
            for parent in parents:
                node = node.get(parent) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(key, None)
        client = ((recipe or {}).get("federated") or {}).get("client")
        if isinstance(client, dict) and "algorithm" not in client:
            algorithm = _algorithm_run_before_it_was_named(client)
            if algorithm is not None:
                client["algorithm"] = algorithm
    return config


def record_ran_hash(record: ResultRecord, without: tuple[str, ...] = ("seed",)) -> str:
    """ran_hash of the record's config read as today's (current_config): a key the code no
    longer reads (a retired one) makes no other configuration, so it cannot split a row."""
    return ran_hash(current_config(record.config or {}), without)


def filed_once_key(record: ResultRecord) -> tuple[str, int]:
    """What is filed at most once: a config (seed included; record_ran_hash, so a reworded
    baseline description is the same config) run by code of one numerics version."""
    return record_ran_hash(record, without=()), record_numerics_version(record)
