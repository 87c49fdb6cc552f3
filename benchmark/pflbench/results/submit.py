"""`pflbench submit RUN_DIR`: check a finished run's record and file it under results/.

Every check recomputes what can be recomputed (record id, config hash, ε by the pinned
accountants, every WER/CER figure from the run's stored hypotheses: rescore.py) and refuses with a
UserError that names the file and the reason. The ε held against the budget is the budget's
accountant's; every other accountant's claim is verified too. A run checked by `pflbench verify`
has a stamp, checked against the record and filed with it.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from pflbench.errors import UserError
from pflbench.numerics import NUMERICS_CHANGES, NUMERICS_VERSION
from pflbench.results.schema import (
    ResultRecord,
    current_config,
    filed_once_key,
    load_record,
    read_json_file,
    record_numerics_version,
)
from pflbench.spec.models import Budget, PrivacyRecipe, RunConfig
from pflbench.spec.names import safe_name
from pflbench.spec.registry import Registry, format_validation_error
from pflbench.spec.resolve import config_json_hash, resolve, what_config_ran

if TYPE_CHECKING:
    from pflbench.privacy.accounting import MechanismDescription
    from pflbench.results.rescore import DataOptions

EXACT_RTOL = 1e-9  # z = σ_DP·S and q = S/K are products of the claim's own numbers
SIGMA_RTOL = 1e-6  # σ_DP vs the budget's calibration (deterministic; slack for the libraries)


class AlreadyFiled(UserError):
    """The run's very record is filed already (same id, same content): nothing to do."""


@dataclass(frozen=True)
class Accepted:
    record: ResultRecord
    path: Path
    stale: bool
    reevaluated: bool  # filed with `pflbench verify`'s stamp
    # Data sets that matched the record's by their audio digest only (this CPU's features differ).
    audio_only: list[str]


def record_path(results_root: Path, record: ResultRecord) -> Path:
    """results/<task>/<budget>/<record-id>.json: every component checked, never outside the root."""
    task = safe_name(record.task.name, "task name")
    budget = safe_name(record.budget, "budget name")
    path = Path(results_root) / task / budget / f"{record.record_id}.json"
    root = Path(results_root).resolve()
    if root not in path.resolve().parents:
        raise UserError(f"refusing to write {path}: it is outside {root}")
    return path


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0) or (math.isinf(a) and a == b)


def epsilon_rtol(accountant: str) -> float:
    """How closely a re-accounted ε must match a claim by `accountant`: as closely as two
    machines' agree (Accountant.agreement_rtol; opacus' example-level accountants as the method
    they run)."""
    from pflbench.privacy.accountants import get_accountant
    from pflbench.privacy.example import EXAMPLE_ACCOUNTANTS

    return get_accountant(EXAMPLE_ACCOUNTANTS.get(accountant, accountant)).agreement_rtol


def within_statement_slack(field: str, stated, value) -> bool:
    """Whether two numbers at `field` (a dotted path) of a privacy statement agree as two
    machines' statements of one run do: an accountant's results (under epsilon.<accountant>)
    within epsilon_rtol, every other number (arithmetic on the config's) within EXACT_RTOL."""
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (stated, value)):
        return False
    parts = field.replace("[", ".").split(".")
    named = [parts[i + 1] for i in range(len(parts) - 1) if parts[i] == "epsilon"]
    rtol = epsilon_rtol(named[0]) if named else EXACT_RTOL
    return _close(float(stated), float(value), rtol)


# ----------------------------------------------------------------------------------------------
# Checks


def parse_config(stored: dict, where: str) -> RunConfig:
    """A stored config as today's RunConfig (current_config), or a UserError naming `where`."""
    try:
        return RunConfig.model_validate(current_config(stored))
    except ValidationError as exc:
        raise UserError(format_validation_error(where, exc)) from None


def what_ran(stored: dict, where: str = "config") -> dict:
    """The task and recipe a stored config ran (older configs read as the code ran them then:
    current_config), seed included; the baseline's own text and the spelling of its --set
    overrides may differ between configs that ran the same."""
    config = parse_config(stored, where)
    return config.model_dump(mode="json", include={"task", "recipe", "seed"})


def check_config(record: ResultRecord, raw: dict, where: str) -> RunConfig:
    """The stored config parses, its hash is the claimed one, and it names what the record says."""
    config = parse_config(raw["config"], f"{where}: config")
    actual = config_json_hash(raw["config"])
    if actual != record.config_hash:
        raise UserError(
            f"{where}: config_hash {record.config_hash} does not match the stored config "
            f"(its hash is {actual})"
        )
    claimed = (record.task.name, record.task.version, record.baseline, record.budget, record.seed)
    actual_ids = (
        config.task.name,
        config.task.version,
        config.baseline.name,
        config.budget.name,
        config.seed,
    )
    if claimed != actual_ids:
        raise UserError(
            f"{where}: the record says (task, version, baseline, budget, seed) = {claimed} "
            f"but its config says {actual_ids}"
        )
    return config


def check_config_resolves(config: RunConfig, registry: Registry, where: str) -> None:
    """The stored config is what the registry resolves for its task, baseline, budget, seed and
    --set overrides: a config edited in place, its hash recomputed, would credit a baseline with
    a run of another recipe (or, edited where nothing reads it, a baseline's `overrides` say,
    split one configuration's seeds into two rows). Checked on records of the current task
    version (an older one no longer resolves)."""
    from pflbench.results.rescore import first_difference

    sets = [f"{key}={value}" for key, value in config.overrides.items()]
    names = (config.task.name, config.baseline.name, config.budget.name)
    fresh = resolve(registry, *names, config.seed, sets)
    # All of it but the baseline's and budget's own words, which may be reworded.
    found = first_difference(
        what_config_ran(config.model_dump(mode="json"), without=()),
        what_config_ran(fresh.model_dump(mode="json"), without=()),
        "config",
    )
    if found is not None:
        field, stored, resolved = found
        raise UserError(
            f"{where}: {field} is {stored!r}, but task {names[0]!r} with baseline {names[1]!r}, "
            f"budget {names[2]!r} and the record's --set overrides {config.overrides} resolve to "
            f"{resolved!r}: the config is not the one its baseline runs"
        )


def check_run_dir_config(run_dir: Path, record: ResultRecord) -> None:
    """The run directory's config.json is the config the record was made from."""
    path = run_dir / "config.json"
    stored = read_json_file(path)
    if not isinstance(stored, dict) or config_json_hash(stored) != record.config_hash:
        raise UserError(
            f"{path}: the resolved config of the run does not match the record's config_hash "
            f"{record.config_hash}"
        )


def check_compute(record: ResultRecord, config: RunConfig, where: str) -> None:
    """What the leaderboard shows of a run's compute follows from the record: its central steps
    are the config's (one cohort size per step; none without federated training), and its
    GPU-hours are its wall time × processes on a GPU (0 on a CPU)."""
    recipe = config.recipe
    expected = recipe.federated.central_steps if recipe.training == "federated" else 0
    compute = record.compute
    if compute.central_steps != expected:
        raise UserError(
            f"{where}: compute.central_steps is {compute.central_steps!r}, but the config "
            f"(training: {recipe.training}) runs {expected}"
        )
    if compute.cohort_per_step is not None and len(compute.cohort_per_step) != expected:
        raise UserError(
            f"{where}: compute.cohort_per_step has {len(compute.cohort_per_step)} entries, one "
            f"per central step is {expected}"
        )
    gpu_hours = 0.0
    if compute.device == "cuda":
        gpu_hours = (compute.wall_seconds or 0.0) * (compute.num_processes or 1) / 3600
    if compute.gpu_hours is None or not _close(compute.gpu_hours, gpu_hours, EXACT_RTOL):
        raise UserError(
            f"{where}: compute.gpu_hours is {compute.gpu_hours!r}, but its device "
            f"{compute.device!r}, wall_seconds and num_processes give {gpu_hours!r}"
        )


def check_seed_model(record: ResultRecord, config: RunConfig, where: str) -> None:
    """A run of a task and recipe whose seed model ships with pflbench started from it (the runner
    takes the shipped one wherever there is one): `data.digests['seed_model']` (which `pflbench
    compare` relies on to pair rows) is its digest."""
    from pflbench.central import shipped_seed_digest

    expected = shipped_seed_digest(config.task, config.recipe)
    stated = record.data.digests.get("seed_model")
    if expected is not None and stated != expected:
        raise UserError(
            f"{where}: data.digests.seed_model is {stated!r}, but every run of this task and "
            f"recipe starts from the seed model shipped with it, {expected}"
        )


def check_task_version(
    record: ResultRecord, registry: Registry, where: str, stale_ok: bool
) -> bool:
    """True when the record's task version is older/newer than the registry's, or its code's
    numerics older than this pflbench's (a stale result)."""
    current = registry.task(record.task.name).spec.version
    numerics = record_numerics_version(record)
    if record.task.version > current or numerics > NUMERICS_VERSION:
        raise UserError(
            f"{where}: the run states task {record.task.name!r} version {record.task.version} "
            f"and numerics version {numerics}; this pflbench has version {current} and numerics "
            f"{NUMERICS_VERSION}: a newer one cannot be checked here (update pflbench)"
        )
    # A record that states no numerics is version 1's, as everywhere (the leaderboard's stale
    # mark, the sweep manifest, reproduce): stale work, filed only with stale_ok.
    if current == record.task.version and numerics == NUMERICS_VERSION:
        return False
    if not stale_ok:
        if current != record.task.version:
            why = (
                f"task {record.task.name!r} is version {current} in the registry but the run "
                f"used version {record.task.version}"
            )
        else:
            why = (
                f"the run's code computed numbers as numerics version {numerics}, this pflbench "
                f"as {NUMERICS_VERSION} ({NUMERICS_CHANGES.get(NUMERICS_VERSION, '')})"
            )
        raise UserError(f"{where}: {why}; rerun it, or pass --stale to file it marked stale")
    return True


def check_eval_sets(config: RunConfig, registry: Registry, where: str) -> None:
    """The run's eval sets are the task's today, whatever its version: re-scoring builds the
    references from the record's own definitions, so a stale record (whose config is not resolved
    again) could otherwise name another subset as `cv-test` and be scored on it."""
    current = registry.task(config.task.name).spec.eval_sets
    if [e.model_dump() for e in config.task.eval_sets] != [e.model_dump() for e in current]:
        raise UserError(
            f"{where}: config.task.eval_sets are not task {config.task.name!r}'s eval sets "
            f"({', '.join(f'{e.name}: {e.corpus} {e.subset}' for e in current)}): its WERs "
            "cannot be compared with the other rows"
        )


def check_budget(config: RunConfig, registry: Registry, where: str) -> Budget:
    budget = registry.budget(config.budget.name).spec
    if budget != config.budget:
        raise UserError(
            f"{where}: budget {budget.name!r} in the registry differs from the one the run used"
        )
    return budget


def check_record_privacy(
    privacy: dict | None, config: RunConfig, budget: Budget, where: str
) -> None:
    """Recompute every ε claim with the pinned accountants, for the mechanism the config names,
    hold the budget's accountant's against the budget, and require the σ_DP the budget
    prescribes."""
    from pflbench.privacy.mechanisms import mechanism_class
    from pflbench.privacy.run import check_sampling_accountable, run_sigma_dp
    from pflbench.privacy.statement import check_steps_within_budget

    if not budget.dp:
        if privacy is not None and privacy.get("dp"):
            raise UserError(
                f"{where}: the record claims DP but is filed under budget {budget.name!r}"
            )
        return
    if privacy is None or not privacy.get("dp"):
        raise UserError(f"{where}: budget {budget.name!r} needs a DP privacy claim; none found")
    if budget.unit == "example":
        check_example_privacy(privacy, config, budget, where)
        return
    recipe = config.recipe
    check_sampling_accountable(config, where)
    check_steps_within_budget(recipe.federated.central_steps, budget, where, recipe.privacy)
    sigma_dp = privacy.get("sigma_dp")
    if not isinstance(sigma_dp, int | float) or not sigma_dp > 0:
        raise UserError(f"{where}: privacy.sigma_dp must be a number > 0, got {sigma_dp!r}")
    unit = "pseudo-user" if config.task.federated_data.iid else "user"
    expected = {
        "mechanism": mechanism_class(recipe.privacy).statement(recipe.privacy, unit),
        "clip_bound": recipe.privacy.clip_bound,
        "sampling": recipe.federated.sampling,
        # Older records name no accountant or unit: theirs were rdp (the only budget accountant
        # then) and user (no -iid run was ever filed).
        "claimed_by": budget.accountant,
        "unit": unit,
    }
    defaults = {"claimed_by": "rdp", "unit": "user"}
    for key, value in expected.items():
        claimed = privacy.get(key, defaults.get(key))
        if claimed != value:
            raise UserError(f"{where}: privacy.{key} is {claimed!r} but the config says {value!r}")
    population = (privacy.get("simulated") or {}).get("population")
    # The runner caps the cohort at the population of the (small) simulated corpus.
    cohort = min(recipe.federated.cohort_size, population or recipe.federated.cohort_size)
    scales = {
        "simulated": (None, cohort, recipe.federated.central_steps),
        "extrapolated": (budget.population, budget.cohort, budget.steps),
    }
    claimed = budget.accountant
    fresh_ext = None
    for scale, (population, cohort, steps) in scales.items():
        claim = privacy.get(scale)
        if not isinstance(claim, dict):
            raise UserError(f"{where}: privacy.{scale} is missing")
        shape = {"population": population, "cohort": cohort, "steps": steps}
        for key, value in shape.items():
            if value is not None and claim.get(key) != value:
                raise UserError(
                    f"{where}: privacy.{scale}.{key} is {claim.get(key)!r}, expected {value!r}"
                )
        fresh = check_scale(
            claim, sigma_dp, budget.delta, f"{where}: privacy.{scale}", claimed, recipe.privacy
        )
        if scale == "extrapolated":
            fresh_ext = fresh[claimed]
    _check_within_budget(fresh_ext, budget, where, "extrapolated", claimed, "extrapolated scale")
    prescribed = run_sigma_dp(config)  # the accountants cache the calibration's ε values
    if not _close(float(sigma_dp), prescribed, SIGMA_RTOL):
        # More noise than the run added would pass every ε check above on its own.
        raise UserError(
            f"{where}: privacy.sigma_dp is {sigma_dp!r}, but budget {budget.name!r} prescribes "
            f"{prescribed!r} for this mechanism (what every run of it adds)"
        )


def check_privacy_statement(privacy: dict | None, config: RunConfig, where: str) -> None:
    """The claim is, field for field, the statement pflbench writes for the config, the claimed
    σ_DP, the simulated population and the accountants it names (privacy.run.privacy_claim): its
    `how`, budget and target ε too, not only the numbers check_record_privacy recomputes. Keys
    other code adds (an algorithm's payload note, the audit: check_audit_claim) are not the
    statement's; an example-level claim is check_example_privacy's."""
    from pflbench.privacy.accountants import ACCOUNTANTS
    from pflbench.privacy.run import privacy_claim

    if config.recipe.training == "dpsgd-example":
        return
    if privacy is None:
        raise UserError(f"{where}: privacy is missing: every run record states how private it is")
    simulated = privacy.get("simulated") or {}
    named = simulated.get("epsilon") or {}
    accountants = [name for name in ACCOUNTANTS if name in named] or list(ACCOUNTANTS)
    fresh = privacy_claim(
        config, privacy.get("sigma_dp", 0.0), simulated.get("population", 0), accountants
    )
    _check_statement_fields(privacy, fresh, "privacy statement", where)


def _check_statement_fields(privacy: dict, fresh: dict, what: str, where: str) -> None:
    """The claim's fields are `fresh`'s (pflbench's own statement for the run), numbers within
    the slack two machines' statements of one run differ by."""
    from pflbench.results.rescore import differences

    claimed = {key: privacy.get(key) for key in fresh}
    for field, stated, value in differences(claimed, fresh, "privacy"):
        if not within_statement_slack(field, stated, value):
            raise UserError(
                f"{where}: {field} is {stated!r}, but pflbench's {what} for this config and σ_DP"
                f" says {value!r}"
            )


def check_example_privacy(privacy: dict, config: RunConfig, budget: Budget, where: str) -> None:
    """An example-level DP-SGD claim (privacy/example.py): unit example, the config's clip bound
    and steps, opacus' accountant of the budget recomputing the claimed ε for the claim's own
    (z, q = B/N, T, δ), that ε within the budget, and z the one the budget prescribes at that
    (q, T), as the runner calibrates it."""
    from pflbench.privacy.example import (
        clipping_words,
        example_noise_multiplier,
        example_statement,
    )
    from pflbench.privacy.sampling import sampling_rate

    expected = {
        "unit": "example",
        "sampling": "poisson",
        "claimed_by": budget.accountant,
        "clip_bound": config.recipe.privacy.clip_bound,
    }
    for key, value in expected.items():
        if privacy.get(key) != value:
            raise UserError(
                f"{where}: privacy.{key} is {privacy.get(key)!r} but the config says {value!r}"
            )
    if privacy.get("extrapolated") is not None:
        raise UserError(f"{where}: an example-level claim has no extrapolated scale")
    sigma_dp = privacy.get("sigma_dp")
    if not isinstance(sigma_dp, int | float) or not sigma_dp > 0:
        raise UserError(f"{where}: privacy.sigma_dp must be a number > 0, got {sigma_dp!r}")
    claim = privacy.get("simulated")
    if not isinstance(claim, dict):
        raise UserError(f"{where}: privacy.simulated is missing")
    steps = (config.recipe.fine_tune or config.recipe.central).steps
    if claim.get("steps") != steps:
        raise UserError(
            f"{where}: privacy.simulated.steps is {claim.get('steps')!r}, expected {steps}"
        )
    fresh = _check_example_scale(claim, sigma_dp, budget.delta, where, budget.accountant)
    epsilon = fresh[budget.accountant]
    _check_within_budget(epsilon, budget, where, "simulated", budget.accountant, "per example")
    batch, examples = claim["cohort"], claim["population"]
    prescribed = example_noise_multiplier(budget, sampling_rate(examples, batch), steps)
    if not _close(float(sigma_dp) * batch, prescribed, SIGMA_RTOL):
        # More noise than the run added would pass every ε check above on its own.
        raise UserError(
            f"{where}: privacy.sigma_dp is {sigma_dp!r} (z = σ_DP·B = {sigma_dp * batch!r}), "
            f"but budget {budget.name!r} prescribes z = {prescribed!r} for B = {batch}, "
            f"N = {examples}, T = {steps} (what every run of it adds)"
        )
    # The rest of the statement, field for field, as the runner writes it (its words too).
    fresh = example_statement(
        float(sigma_dp) * batch, config.recipe.privacy.clip_bound,
        clipping_words(config.recipe.privacy), examples, batch, steps, budget,
    )  # fmt: skip
    _check_statement_fields(privacy, fresh, "example-level statement", where)


def _check_within_budget(
    epsilon: float | None, budget: Budget, where: str, scale: str, accountant: str, what: str
) -> None:
    """The freshly computed ε of the claim's `scale` by `accountant` exists and is within the
    budget it is filed under."""
    if epsilon is None:
        raise UserError(f"{where}: privacy.{scale}.epsilon.{accountant}: no ε claimed")
    if epsilon > budget.epsilon * (1 + EXACT_RTOL):
        raise UserError(
            f"{where}: ε = {epsilon:.4g} ({accountant}, {what}) is above the budget"
            f" {budget.name!r} (ε = {budget.epsilon})"
        )


def _check_example_scale(
    claim: dict, sigma_dp: float, delta: float, where: str, claimed: str
) -> dict[str, float]:
    """check_scale for an example-level claim: z = σ_DP·B and q = B/N from the claim's expected
    batch B (`cohort`) and examples N (`population`), every claimed ε recomputed by opacus'
    accountant (privacy.example.example_epsilon); returns the fresh ε by accountant."""
    from pflbench.privacy.example import example_epsilon

    where = f"{where}: privacy.simulated"
    cohort, population, steps = claim["cohort"], claim["population"], claim["steps"]
    z, q = sigma_dp * cohort, cohort / population
    for key, value in (("noise_multiplier", z), ("sampling_rate", q)):
        if not _close(float(claim[key]), value, EXACT_RTOL):
            raise UserError(f"{where}.{key} is {claim[key]!r} but σ_DP, B, N give {value!r}")
    epsilons = claim.get("epsilon") or {}
    if not isinstance(epsilons.get(claimed), dict):
        raise UserError(f"{where}.epsilon has no {claimed!r} claim (the budget's accountant)")
    fresh = {}
    for name, item in sorted(epsilons.items()):
        at = f"{where}.epsilon.{name}"
        if not isinstance(item, dict) or item.get("epsilon") is None:
            raise UserError(f"{at}: expected an ε claim, got {item!r}")
        analysed = {"noise_multiplier": z, "sampling_rate": q, "steps": steps, "delta": delta}
        for key, value in analysed.items():
            if item.get(key) is None or not _close(float(item[key]), value, EXACT_RTOL):
                raise UserError(f"{at}.{key} is {item.get(key)!r}, expected {value!r}")
        fresh[name] = example_epsilon(z, q, steps, delta, name).epsilon
        if not _close(float(item["epsilon"]), fresh[name], epsilon_rtol(name)):
            raise UserError(
                f"{at}: claimed ε = {item['epsilon']!r} but opacus' {name} accountant gives "
                f"{fresh[name]!r} for z = {z}, q = {q}, T = {steps}, δ = {delta}"
            )
    return fresh


def check_scale(
    claim: dict, sigma_dp: float, delta: float, where: str, claimed: str, privacy: PrivacyRecipe
) -> dict[str, float | None]:
    """Check one scale's claims (every accountant's, the `claimed` one required) against a fresh
    computation for the mechanism `privacy` names; returns the fresh ε by accountant (None where
    it cannot be computed)."""
    from pflbench.privacy.mechanisms import mechanism_class
    from pflbench.privacy.statement import described_at_scale

    cohort, population, steps = claim["cohort"], claim["population"], claim["steps"]
    described = described_at_scale(privacy, sigma_dp, cohort, population, steps)
    stated = {
        "noise_multiplier": described.noise_multiplier,
        "sampling_rate": described.sampling_rate,
        **mechanism_class(privacy).scale_record(described),
    }
    for key, value in stated.items():
        if not _same_json(claim.get(key), value):
            raise UserError(f"{where}.{key} is {claim.get(key)!r} but σ_DP, S, K give {value!r}")
    epsilons = claim.get("epsilon") or {}
    if not isinstance(epsilons.get(claimed), dict):
        raise UserError(f"{where}.epsilon has no {claimed!r} claim (the budget's accountant)")
    return {
        name: check_epsilon_claim(name, item, described, delta, f"{where}.epsilon.{name}")
        for name, item in sorted(epsilons.items())
    }


def check_epsilon_claim(
    name: str, item: dict | None, described: MechanismDescription, delta: float, where: str
) -> float | None:
    """A fresh ε from the pinned accountant must match the claim; returns it (None when the
    accountant cannot compute it and the claim says so)."""
    from pflbench.privacy.accountants import compute_epsilon

    if not isinstance(item, dict) or item.get("accountant") != name:
        raise UserError(f"{where}: expected a {name} ε claim, got {item!r}")
    if item.get("epsilon") is None:
        try:
            value = compute_epsilon(described, delta, accountant=name).epsilon
        except UserError:
            return None  # the claim says this accountant cannot compute it, and indeed it cannot
        raise UserError(f"{where}: no ε claimed, but the {name} accountant gives {value!r}")
    fresh = compute_epsilon(described, delta, accountant=name)
    # What the accountant analysed (the description, or what it reduces to).
    analysed = {
        "noise_multiplier": fresh.noise_multiplier,
        "sampling_rate": fresh.sampling_rate,
        "steps": fresh.steps,
        "delta": delta,
    }
    for key, value in analysed.items():
        if item.get(key) is None or not _close(float(item[key]), value, EXACT_RTOL):
            raise UserError(f"{where}.{key} is {item.get(key)!r}, expected {value!r}")
    if not _close(float(item["epsilon"]), fresh.epsilon, epsilon_rtol(name)):
        raise UserError(
            f"{where}: claimed ε = {item['epsilon']!r} but the {name} accountant gives "
            f"{fresh.epsilon!r} for {described}, δ = {delta}"
        )
    return fresh.epsilon


def _same_json(claimed, value) -> bool:
    """A claimed JSON value equals a fresh one, numbers to EXACT_RTOL."""
    if isinstance(value, dict):
        return (
            isinstance(claimed, dict)
            and claimed.keys() == value.keys()
            and all(_same_json(claimed[k], v) for k, v in value.items())
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return claimed == value
    return isinstance(claimed, int | float) and _close(float(claimed), value, EXACT_RTOL)


def find_duplicate(record: ResultRecord, folder: Path) -> Path | None:
    """An existing record with the same id, or from the same config (same seed included; a
    baseline's reworded description is the same config: ran_hash) run by code of the same
    numerics: a re-run by today's code of a stale run is filed beside it, which stands in until
    its row is filed again whole (`pflbench results retire-replaced`)."""
    same_id = folder / f"{record.record_id}.json"
    if same_id.exists():
        return same_id
    ran = filed_once_key(record)
    for path in sorted(folder.glob("*.json")):
        other, _ = load_record(path)
        if other.config is not None and filed_once_key(other) == ran:
            return path
    return None


# ----------------------------------------------------------------------------------------------
# The whole check and the filing


def validate_record(
    record: ResultRecord, raw: dict, registry: Registry, where: str, stale_ok: bool = False
) -> bool:
    """All content checks of a run record (not the duplicate check); returns whether it is stale.
    Every error names `where`, also one from the registry or the resolver (an unknown task,
    baseline or budget, a recipe that no longer validates)."""
    try:
        return _validate_record(record, raw, registry, where, stale_ok)
    except UserError as error:
        if str(error).startswith(where):
            raise
        raise UserError(f"{where}: {error}") from None


def _validate_record(
    record: ResultRecord, raw: dict, registry: Registry, where: str, stale_ok: bool
) -> bool:
    from pflbench.plugins import check_record_plugins
    from pflbench.privacy.audit import check_audit_claim

    if record.kind != "run":
        raise UserError(f"{where}: only run records can be submitted (kind is {record.kind!r})")
    plugins = record.software.plugins or []
    check_record_plugins([plugin.model_dump() for plugin in plugins], where)
    config = check_config(record, raw, where)
    stale = check_task_version(record, registry, where, stale_ok)
    check_eval_sets(config, registry, where)
    budget = check_budget(config, registry, where)
    # A record of the current task version resolves today whatever its numerics version (stale
    # numerics change a run's last bits, not its recipe).
    if registry.task(record.task.name).spec.version == record.task.version:
        check_config_resolves(config, registry, where)
        check_seed_model(record, config, where)
    check_record_privacy(raw.get("privacy"), config, budget, where)
    check_privacy_statement(raw.get("privacy"), config, where)
    check_audit_claim(
        raw.get("privacy"), config.recipe.privacy.audit_canaries, where, per_canary=not stale
    )
    check_compute(record, config, where)
    return stale


def submit(
    run_dir: Path,
    results_root: Path,
    registry: Registry,
    stale_ok: bool = False,
    data: DataOptions | None = None,
) -> Accepted:
    """Check a finished run and file its record, hypotheses and verification stamp (if any) at
    results/<task>/<budget>/<record id>.json and <record id>/. `data`: where the eval sets'
    references come from for re-scoring."""
    from pflbench.results.leaderboard import VERIFICATION_FILE, filed_dir
    from pflbench.results.rescore import DataOptions, rescore_run_dir
    from pflbench.results.verify import check_stamp, load_stamp
    from pflbench.rundir import HYPOTHESES_DIR, check_finished, hypotheses_file

    run_dir = Path(run_dir)
    check_finished(run_dir, "; submit finished runs only")
    record_file = run_dir / "record.json"
    record, raw = load_record(record_file)
    dest = record_path(results_root, record)
    # Filing over several sessions submits a sweep's whole folder again: its filed runs are
    # reported as such, not refused (`results validate` checks what is filed).
    if dest.is_file() and read_json_file(dest) == raw:
        raise AlreadyFiled(f"{run_dir}: already filed as {dest}")
    stale = validate_record(record, raw, registry, str(record_file), stale_ok)
    check_run_dir_config(run_dir, record)
    duplicate = find_duplicate(record, dest.parent)
    if duplicate is not None:
        raise UserError(f"{record_file}: a duplicate of {duplicate} (same record or same config)")
    config = check_config(record, raw, str(record_file))
    audio_only = rescore_run_dir(record, config, run_dir, data or DataOptions())
    stamp_file = run_dir / VERIFICATION_FILE
    if stamp_file.is_file():
        check_stamp(load_stamp(stamp_file), record, str(stamp_file))
    # What CI re-checks goes first, the record last: a filed record always has its hypotheses.
    folder = filed_dir(dest)
    (folder / HYPOTHESES_DIR).mkdir(parents=True, exist_ok=True)
    for name in record.outputs.hypotheses:
        source = hypotheses_file(run_dir / HYPOTHESES_DIR, name)
        shutil.copyfile(source, hypotheses_file(folder / HYPOTHESES_DIR, name))
    if stamp_file.is_file():
        shutil.copyfile(stamp_file, folder / VERIFICATION_FILE)
    # Re-serialising keeps the record's id (the id is over canonical content).
    dest.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return Accepted(record, dest, stale, stamp_file.is_file(), audio_only)
