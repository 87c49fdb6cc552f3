"""Resolve task ⊕ baseline ⊕ --set overrides ⊕ seed into a frozen, hashed RunConfig."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import yaml

from pflbench.errors import UserError
from pflbench.spec.models import Recipe, RunConfig
from pflbench.spec.registry import Registry, load_yaml, validate


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_set(assignments: list[str]) -> tuple[dict, dict[str, str]]:
    """`a.b=8` → ({'a': {'b': 8}}, {'a.b': '8'}): the nested override and the strings as given.

    Values are parsed as YAML scalars (numbers, booleans, null, lists)."""
    nested: dict = {}
    given: dict[str, str] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise UserError(
                f"--set {item!r}: expected key.path=value, e.g. federated.cohort_size=8"
            )
        try:
            value = load_yaml(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item!r}: {part!r} is set both as a value and a section")
        overlapping = next(
            (k for k in given if k.startswith(key + ".") or key.startswith(k + ".")), None
        )
        if overlapping is not None:
            # A section set whole would replace (or merge with) the other key's value depending
            # on the order, and a record's overrides (a mapping) keep no order.
            raise UserError(
                f"--set {key} and --set {overlapping} overlap: set the section's keys one by one, "
                "or all of them in the one mapping"
            )
        node[parts[-1]] = value
        given[key] = raw
    return nested, given


def resolve(
    registry: Registry,
    task: str,
    baseline: str,
    budget: str = "none",
    seed: int = 0,
    sets: list[str] | None = None,
) -> RunConfig:
    task_l = registry.task(task)
    baseline_l = registry.baseline(baseline)
    budget_l = registry.budget(budget)
    recipe = task_l.spec.recipe.model_dump()
    recipe = deep_merge(recipe, baseline_l.spec.overrides)
    set_tree, given = parse_set(sets or [])
    recipe = deep_merge(recipe, set_tree)
    resolved = validate(Recipe, recipe, f"recipe of task {task!r} + baseline {baseline!r} + --set")
    return RunConfig(
        task=task_l.spec,
        baseline=baseline_l.spec,
        budget=budget_l.spec,
        seed=seed,
        recipe=resolved,
        overrides=given,
    )


def default_budget(registry: Registry, task: str, baseline: str, sets: list[str]) -> str:
    """The budget of a run given none: the task's first budget for federated training that clips
    client updates (what a DP budget applies to), else `none`."""
    recipe = resolve(registry, task, baseline, "none", 0, sets).recipe
    budgets = registry.task(task).spec.budgets
    private = recipe.training == "federated" and recipe.privacy.clipping != "none"
    return budgets[0] if private and budgets else "none"


def canonical_json(obj: Any) -> str:
    """The one serialization hashes are taken over: sorted keys, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_json_hash(config_json: dict) -> str:
    """sha256 of a resolved config's JSON (RunConfig.model_dump(mode="json"), or as stored)."""
    return hashlib.sha256(canonical_json(config_json).encode()).hexdigest()


# A baseline's and a budget's own words: reworded, they run the same, so a filed run and its
# rerun after the rewording are one configuration (one leaderboard row, one filed run per seed).
WORDS = {"baseline": ("description", "reproduces"), "budget": ("description",)}


def what_config_ran(config: dict, without: tuple[str, ...] = ("seed",)) -> dict:
    """A stored config (RunConfig's JSON) with its keys `without`, its baseline's and budget's
    words (WORDS) and its --set overrides as typed left out: the recipe holds what they set, so
    `lr=1e-3` and `lr=0.001` ran the same."""
    kept = {k: v for k, v in config.items() if k not in (*without, "overrides")}
    for part, words in WORDS.items():
        if isinstance(kept.get(part), dict):
            kept[part] = {k: v for k, v in kept[part].items() if k not in words}
    return kept


_MISSING = object()


def set_values(config: dict) -> dict[str, str]:
    """A stored config's --set overrides, each with the value its recipe resolved it to, spelled
    one way (`1e-3`, `.001` and `0.001` all read `0.001`): how rows and figures name them. A
    section set whole (`federated.server={lr: 0.5}`) reads as the keys it set
    (`federated.server.lr=0.5`), as it ran."""
    overrides = config.get("overrides") or {}
    given, _ = parse_set([f"{key}={typed}" for key, typed in overrides.items()])
    return dict(_set_leaves(given, config.get("recipe") or {}, ""))


def _set_leaves(given: dict, resolved: Any, prefix: str):
    """(dotted key, spelled value) of each leaf --set gave, its value read from `resolved`."""
    for key, value in given.items():
        found = resolved.get(key, _MISSING) if isinstance(resolved, dict) else _MISSING
        if isinstance(value, dict) and value:
            yield from _set_leaves(value, found, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", _spell(value if found is _MISSING else found)


def _spell(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return repr(value).removesuffix(".0")  # 500, as typed, not 500.0
    return canonical_json(value)  # ints, true/false/null as YAML reads them, lists, mappings


def ran_hash(config: dict, without: tuple[str, ...] = ("seed",)) -> str:
    """The hash of what_config_ran: what the leaderboard groups seeds by, and what a filed run
    may not repeat (seed included)."""
    return config_json_hash(what_config_ran(config, without))


def config_hash(config: RunConfig) -> str:
    return config_json_hash(config.model_dump(mode="json"))


def spec_config_hashes(registry: Registry) -> dict[str, str]:
    """`task/baseline` -> config hash (budget none, seed 0) for every task x baseline: the golden
    hashes a change to the specs or their models must keep (tests/fixtures)."""
    return {
        f"{task}/{baseline}": config_hash(resolve(registry, task, baseline, "none", 0))
        for task in sorted(registry.tasks)
        for baseline in sorted(registry.baselines)
    }
