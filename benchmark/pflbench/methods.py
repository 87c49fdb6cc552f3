"""The names a spec gives pluggable methods, checked against the registries that define them.

Specs (pflbench.spec) are pure data and hold names only: a corpus, a server optimizer, an
accountant, a client algorithm, a privacy mechanism. Built-in modules and plug-ins
(pflbench.plugins) register what the names mean (pflbench.extension.ExtensionPoint). This module
sits above both, so that loading specs checks every name and an unknown one is an error that
lists the known names, before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pflbench.data.adapters import CORPORA
from pflbench.errors import UserError
from pflbench.fl.algorithms import CLIENT_ALGORITHMS, check_client_recipe
from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS
from pflbench.privacy.accountants import calibrating
from pflbench.privacy.example import EXAMPLE_ACCOUNTANTS
from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS, check_mechanism_recipe
from pflbench.privacy.run import check_run_privacy
from pflbench.spec.models import Budget, Recipe, RunConfig, Task
from pflbench.spec.registry import Registry, load_registry


def check_task(task: Task, where: str) -> None:
    """Every corpus the task reads is registered, with a locale where the corpus needs one."""
    sources = [task.seed_data, task.federated_data, *task.eval_sets]
    for source in sources:
        if source is None:
            continue
        if source.corpus not in CORPORA:
            _unknown(where, "corpus", source.corpus, CORPORA)
        if CORPORA[source.corpus].needs_locale and not source.locale:
            raise UserError(f"{where}: a {source.corpus} source needs a locale")


def check_run(config: RunConfig) -> None:
    """What a run needs before anything starts: its budget can cover it (check_run_privacy) and
    every method its recipe names is registered and fits it (a baseline's overrides alone cannot
    be checked whole: the task completes them). `pflbench run` and `pflbench sweep` check this."""
    check_run_privacy(config)
    check_recipe(
        config.recipe, f"task {config.task.name!r} + baseline {config.baseline.name!r} + --set"
    )


def check_recipe(recipe: Recipe | dict[str, Any], where: str) -> None:
    """The recipe's server optimizer, client algorithm and privacy mechanism are registered (a
    dict: a baseline's partial overrides); a whole recipe also fits its client algorithm and its
    mechanism."""
    data = recipe.model_dump() if isinstance(recipe, Recipe) else recipe
    federated = data.get("federated", {})
    optimizer = federated.get("server", {}).get("optimizer")
    if optimizer is not None and optimizer not in SERVER_OPTIMIZERS:
        _unknown(where, "server optimizer", optimizer, SERVER_OPTIMIZERS)
    algorithm = federated.get("client", {}).get("algorithm")
    if algorithm is not None and algorithm not in CLIENT_ALGORITHMS:
        _unknown(where, "client algorithm", algorithm, CLIENT_ALGORITHMS)
    mechanism = data.get("privacy", {}).get("mechanism")
    if mechanism is not None and mechanism not in PRIVACY_MECHANISMS:
        _unknown(where, "privacy mechanism", mechanism, PRIVACY_MECHANISMS)
    if isinstance(recipe, Recipe):
        try:
            check_client_recipe(recipe.federated.client)
            check_mechanism_recipe(recipe)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None


def check_budget(budget: Budget, where: str) -> None:
    """A user-level budget names a registered accountant that calibrates, an example-level one
    one of opacus' own (pflbench.privacy.example)."""
    if budget.unit == "example":
        if budget.accountant not in EXAMPLE_ACCOUNTANTS:
            raise UserError(
                f"{where}: an example-level budget (unit: example) names one of opacus'"
                f" accountants ({', '.join(EXAMPLE_ACCOUNTANTS)}), not {budget.accountant!r}"
            )
        return
    if budget.accountant not in calibrating():
        _unknown(where, "accountant that calibrates noise", budget.accountant, calibrating())


def check_registry(registry: Registry) -> Registry:
    """Every task's, baseline's and budget's names; returns the registry."""
    for name, loaded in registry.tasks.items():
        where = f"task {name!r} ({loaded.path})"
        check_task(loaded.spec, where)
        check_recipe(loaded.spec.recipe, where)
    for name, loaded in registry.baselines.items():
        check_recipe(loaded.spec.overrides, f"baseline {name!r} ({loaded.path})")
    for name, loaded in registry.budgets.items():
        check_budget(loaded.spec, f"budget {name!r} ({loaded.path})")
    return registry


def load_specs(extra_dirs: list[Path] | None = None) -> Registry:
    """The spec registry (built-in and extra folders), every name in it checked."""
    return check_registry(load_registry(extra_dirs))


def _unknown(where: str, kind: str, name: str, known) -> None:
    raise UserError(
        f"{where}: unknown {kind} {name!r}; known: {', '.join(known)} "
        "(plug-ins add more: --plugin, PFLBENCH_PLUGINS)"
    )
