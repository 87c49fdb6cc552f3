"""Spec registry, validation errors, --set overrides and the config hash."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
import typer
from click.testing import Result
from pydantic import Field
from typer.testing import CliRunner

from pflbench import __version__
from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.spec.models import ADDED_LATER, PrivacyRecipe, Recipe, Strict
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import (
    config_hash,
    default_budget,
    ran_hash,
    resolve,
    set_values,
    spec_config_hashes,
)

FIXTURE_SPECS = Path(__file__).parent / "fixtures" / "specs"
PAPER_TASKS = {
    "ls960-scratch",
    "ls860-ls100-seed",
    "ls960-cven-seed",
    "cv-en-scratch",
    "cv-en-ls100-seed",
    "cv-en-ls960-seed",
    "cv-en90-cv10-seed",
    "cv-en95-cv05-seed",
    "cv-fr90-cv10-seed",
    "cv-de90-cv10-seed",
    "synth-cv-en-ls-seed",
    "synth-ls-scratch",
    "synth-cv-en-scratch",
}
# Golden: sha256 of the canonical JSON of the fixture run. It changes only when the RunConfig
# schema or the fixture specs change; then review the change and update it deliberately.
GOLDEN_HASH = "036a46bf29c6d59266300c101b174e92cedf49ed4a46fd09a41b13e8702e4eab"


@functools.cache
def fixture_registry():
    """Loaded once (the built-in specs are parsed each time): resolve only reads it, and its
    specs are frozen."""
    return load_registry([FIXTURE_SPECS])


def fixture_config(**kw):
    args = dict(task="fixture-task", baseline="fixture-baseline", budget="fixture-budget", seed=1)
    return resolve(fixture_registry(), **{**args, **kw})


def test_builtin_specs_load_and_resolve():
    reg = load_registry()
    assert PAPER_TASKS <= set(reg.tasks)
    assert {"none", "eps7.2-high-pop", "eps4.5-low-pop"} <= set(reg.budgets)
    for name in reg.tasks:
        assert reg.task(name).spec.version >= 1
        for baseline in reg.baselines:
            for budget in reg.budgets:
                cfg = resolve(reg, name, baseline, budget)
                assert len(config_hash(cfg)) == 64
    high = reg.budget("eps7.2-high-pop").spec
    assert (high.epsilon, high.delta, high.population, high.cohort, high.steps) == (
        7.2,
        1e-9,
        69_506_000,
        204_800,
        2034,
    )


def test_paper_recipe_values():
    reg = load_registry()
    fed = reg.task("cv-en-ls100-seed").spec.recipe.federated
    assert (fed.cohort_size, fed.client.local_steps, fed.central_steps) == (1024, 10, 2000)
    assert (fed.client.lr, fed.server.lr, fed.server.decay.start) == (0.2, 0.002, 750)
    scratch = reg.task("ls960-scratch").spec.recipe.federated
    assert (scratch.client.lr, scratch.server.lr, scratch.client.batch_seconds) == (0.4, 0.006, 360)
    assert reg.task("cv-en90-cv10-seed").spec.seed_data.user_split.part == "in"
    assert reg.task("cv-en90-cv10-seed").spec.federated_data.user_split.part == "out"
    assert reg.task("cv-en-ls100-seed-iid").spec.federated_data.iid


def test_config_hash_golden_and_stable_across_processes():
    digest = config_hash(fixture_config())
    assert digest == GOLDEN_HASH
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from pflbench.spec.registry import load_registry
        from pflbench.spec.resolve import config_hash, resolve
        reg = load_registry([Path({str(FIXTURE_SPECS)!r})])
        print(config_hash(resolve(reg, "fixture-task", "fixture-baseline", "fixture-budget", 1)))
        """
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == digest


def _leaf_paths(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    leaves = []
    for key, value in tree.items():
        if isinstance(value, dict):
            leaves += _leaf_paths(value, f"{prefix}{key}.")
        else:
            leaves.append((f"{prefix}{key}", value))
    return leaves


def _perturbed(value):
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, int):
        return str(value + 1)
    if isinstance(value, float):
        return repr(value / 2 if 0 < value <= 1 else value + 0.5)
    return None


def test_builtin_task_configs_keep_their_golden_hashes():
    """Resolved configs of every built-in task × baseline against the golden file, which
    `pflbench specs hashes --write tests/fixtures/task_config_hashes.json` regenerates; a change
    here changes the identity of every run of that task."""
    golden_file = Path(__file__).parent / "fixtures" / "task_config_hashes.json"
    golden = json.loads(golden_file.read_text())
    hashes = spec_config_hashes(load_registry())
    assert set(hashes) == set(golden)
    assert [key for key in golden if hashes[key] != golden[key]] == []


def test_every_builtin_task_and_baseline_make_a_recipe_that_fits_its_methods():
    """A baseline's options are checked whole only with a task (which completes the recipe):
    every shipped pairing is, as `pflbench run` checks it before it starts."""
    from pflbench.methods import check_recipe, load_specs

    registry = load_specs()
    for task in sorted(registry.tasks):
        for baseline in sorted(registry.baselines):
            config = resolve(registry, task, baseline, "none", 0)
            check_recipe(config.recipe, f"{task} + {baseline}")


def test_a_field_marked_added_later_is_hashed_only_when_set():
    # The rule, not per-field code: any field marked ADDED_LATER drops out at its default.
    class Later(Strict):
        kept: int = 1
        added: float = Field(0.5, json_schema_extra=ADDED_LATER)
        nested: PrivacyRecipe = PrivacyRecipe()

    assert Later().model_dump(mode="json").keys() == {"kept", "nested"}
    assert "audit_canaries" not in Later().model_dump(mode="json")["nested"]
    assert Later(added=0.7).model_dump(mode="json")["added"] == 0.7
    audited = Later(nested=PrivacyRecipe(audit_canaries=3)).model_dump(mode="json")
    assert audited["nested"]["audit_canaries"] == 3


def test_task_includes_merge_templates_under_the_file(tmp_path):
    d = _spec_dir(
        tmp_path,
        {
            "tasks/templates/a.yaml": "recipe: {federated: {cohort_size: 7, client: {lr: 0.3}}}\n",
            "tasks/templates/b.yaml": "recipe: {federated: {cohort_size: 9}}\n"
            + "eval_sets: [{name: x, corpus: commonvoice, subset: dev, locale: en, role: dev}]\n",
            "tasks/my-task.yaml": TASK.replace(
                "version: 1", "include: [templates/a.yaml, templates/b.yaml]\nversion: 1"
            )
            + "recipe: {federated: {client: {local_steps: 3}}}\n",
        },
    )
    loaded = load_registry([d]).task("my-task")
    fed = loaded.spec.recipe.federated
    # later templates win over earlier ones, the task file over all; lists are replaced whole
    assert (fed.cohort_size, fed.client.lr, fed.client.local_steps) == (9, 0.3, 3)
    assert [e.name for e in loaded.spec.eval_sets] == ["d"]
    # the file digest covers the templates: editing one changes it
    before = loaded.sha256
    (d / "tasks/templates/a.yaml").write_text("recipe: {federated: {cohort_size: 8}}\n")
    assert load_registry([d]).task("my-task").sha256 != before


@pytest.mark.parametrize(
    "include, templates, needle",
    [
        ("[templates/missing.yaml]", {}, "missing.yaml does not exist"),
        ("[templates/a.yaml]", {"tasks/templates/a.yaml": "- 1\n"}, "must be a mapping"),
        (
            "[templates/a.yaml]",
            {"tasks/templates/a.yaml": "include: [b.yaml]\n"},
            "cannot include other templates",
        ),
        ("{a: 1}", {}, "expected a list of template file paths"),
    ],
)
def test_bad_includes_name_the_file(tmp_path, include, templates, needle):
    task = TASK.replace("version: 1", f"include: {include}\nversion: 1")
    d = _spec_dir(tmp_path, {"tasks/my-task.yaml": task, **templates})
    with pytest.raises(UserError, match="my-task.yaml|a.yaml") as info:
        load_registry([d])
    assert needle in str(info.value)


def test_config_hash_changes_with_every_resolved_value():
    base_cfg = fixture_config()
    base = config_hash(base_cfg)
    assert config_hash(fixture_config(seed=2)) != base
    changed = 0
    for path, value in _leaf_paths(base_cfg.recipe.model_dump()):
        new = _perturbed(value)
        if new is None:
            continue
        if path == "federated.client.local_epochs":  # exclusive with local_steps
            continue
        cfg = fixture_config(sets=[f"{path}={new}"])
        assert config_hash(cfg) != base, path
        changed += 1
    assert changed > 30


def test_overrides_apply_in_order_and_parse_types():
    cfg = fixture_config(sets=["federated.cohort_size=9", "privacy.perlayer_mode=uniform"])
    assert cfg.recipe.federated.cohort_size == 9
    assert cfg.recipe.privacy.perlayer_mode == "uniform"
    assert cfg.recipe.privacy.clipping == "global"  # from the baseline
    assert cfg.recipe.federated.server.optimizer == "adam"  # from the baseline
    assert cfg.recipe.federated.central_steps == 7  # from the task
    assert cfg.overrides == {"federated.cohort_size": "9", "privacy.perlayer_mode": "uniform"}


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["federated.cohort_sise=3"], "cohort_sise: unknown key"),
        (["federated.cohort_size=many"], "federated.cohort_size"),
        (["privacy.clipping=sometimes"], "privacy.clipping"),
        (["nokey"], "expected key.path=value"),
        # the accountant is the budget's alone (Budget.accountant)
        (["privacy.accountant=pld"], "accountant: unknown key"),
        # client-side noise is only right with exactly S users per step
        (["privacy.noise_placement=client"], "needs federated.sampling: fixed"),
        # a section set whole beside one of its keys: the outcome would depend on the order,
        # which a record's overrides do not keep
        (
            ["federated.server.lr=0.01", "federated.server={optimizer: adam}"],
            "federated.server and --set federated.server.lr overlap",
        ),
        (
            ["federated.server={optimizer: adam}", "federated.server.lr=0.01"],
            "federated.server.lr and --set federated.server overlap",
        ),
    ],
)
def test_bad_set_overrides(sets, needle):
    with pytest.raises(UserError, match=needle.replace(".", r"\.")):
        fixture_config(sets=sets)


def _spec_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


TASK = """\
name: my-task
version: 1
language: en
description: mine
federated_data: {corpus: commonvoice, subsets: [train], locale: en}
eval_sets: [{name: d, corpus: commonvoice, subset: dev, locale: en, role: dev}]
"""


def test_yaml_merge_keys_load_and_a_key_given_twice_beside_one_is_refused():
    import yaml

    from pflbench.spec.registry import _StrictLoader

    text = "base: &b {lr: 1, steps: 2}\nrun:\n  <<: *b\n  lr: 3\n"
    assert yaml.load(text, Loader=_StrictLoader)["run"] == {"lr": 3, "steps": 2}
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'lr'"):
        yaml.load(text + "  lr: 4\n", Loader=_StrictLoader)


def test_user_specs_appear_next_to_builtin(tmp_path, monkeypatch):
    d = _spec_dir(tmp_path, {"tasks/my-task.yaml": TASK})
    assert "my-task" in load_registry([d]).tasks
    assert "cv-en-ls100-seed" in load_registry([d]).tasks
    out = _cli("tasks", "list", "--json", env={"PFLBENCH_SPECS": str(d)})
    assert out.exit_code == 0, out.output
    assert "my-task" in {row["name"] for row in json.loads(out.stdout)}


@pytest.mark.parametrize(
    "files, needles",
    [
        (
            {"tasks/t.yaml": TASK + "recipe: {federated: {cohort_sise: 3}}\n"},
            ["t.yaml", "recipe.federated.cohort_sise", "unknown key"],
        ),
        (
            {"tasks/t.yaml": TASK.replace("version: 1", "version: one")},
            ["t.yaml", "version", "integer"],
        ),
        ({"tasks/t.yaml": TASK.replace("language: en\n", "")}, ["t.yaml", "language", "missing"]),
        (
            {"tasks/t.yaml": TASK + "language: fr\n"},
            ["t.yaml", "duplicate key 'language'"],
        ),
        (
            {"tasks/t.yaml": TASK.replace("my-task", "synth-ls-scratch")},
            ["defined twice", "synth-ls-scratch.yaml", "t.yaml"],
        ),
        (
            {
                "baselines/b.yaml": """\
                name: b
                description: x
                reproduces: y
                overrides: {privacy: {clip_bond: 1.0}}
                """
            },
            ["b.yaml", "overrides", "privacy.clip_bond", "unknown key"],
        ),
        (
            {"tasks/budgets.yaml": "budgets: [{name: b, epsilon: 1.0}]\n"},
            ["budgets.yaml", "budgets[0]", "needs delta"],
        ),
        ({"tasks/t.yaml": "name: [unclosed\n"}, ["t.yaml", "not valid YAML"]),
    ],
)
def test_malformed_specs_name_file_and_key(tmp_path, files, needles):
    d = _spec_dir(tmp_path, files)
    with pytest.raises(UserError) as info:
        load_registry([d])
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    # The CLI raises the same UserError (which `pflbench` prints without a traceback, exit 2).
    out = _cli("tasks", "list", "--specs", str(d))
    assert isinstance(out.exception, UserError) and str(out.exception) == str(info.value)


def test_recipe_rejects_steps_and_epochs_together():
    with pytest.raises(ValueError):
        Recipe.model_validate({"federated": {"client": {"local_steps": 2, "local_epochs": 2}}})


def _cli(*args: str, env: dict | None = None) -> Result:
    """The typer app in this process (UserErrors come back as `.exception`)."""
    return CliRunner().invoke(app, list(args), env=env)


def _process(*args: str) -> subprocess.CompletedProcess:
    """`python -m pflbench` in a new process: its exit code and stderr as a user sees them."""
    return subprocess.run([sys.executable, "-m", "pflbench", *args], capture_output=True, text=True)


def test_cli_help_lists_every_group():
    out = _cli("--help", env={"COLUMNS": "200"})
    assert out.exit_code == 0
    for group in (
        "run tasks baselines budgets privacy data seed eval verify sweep submit leaderboard "
        "results plot bench"
    ).split():
        assert f" {group} " in out.stdout, group


def test_cli_help_shows_flags_as_flags_and_one_line_per_command():
    """A flag's help shows no value to give (`--debug <bool>` read as `--debug true`, which
    fails), and the command list gives each command one line."""
    out = _cli("--help", env={"COLUMNS": "100"})
    commands = out.stdout.split("Commands:")[1].strip().splitlines()
    assert all(len(line.split(maxsplit=1)) == 2 for line in commands), commands
    assert "--debug    Show full tracebacks" in out.stdout
    for command, flag in (
        ("leaderboard", "--check"),
        ("sweep", "--dry-run"),
        ("compare", "--json"),
    ):
        shown = _cli(command, "--help").stdout
        assert re.search(rf"^  {flag} {{2,}}\w", shown, re.MULTILINE), shown  # no value after it
        assert "<bool>" not in shown, command


def _commands(group: typer.Typer | click.Group, path: tuple[str, ...] = ()):
    """Every leaf command's argv path under the CLI."""
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name)


def test_cli_help_names_repeatable_options_by_what_they_take():
    """A repeatable option reads `--set KEY.PATH=VALUE`, not typer's `--set <list[str]>`."""
    root = typer.main.get_command(app)
    seen = 0
    for path in _commands(root):
        shown = _cli(*path, "--help", env={"COLUMNS": "200"}).stdout
        assert not re.search(r"--\S+ <list\[", shown), (path, shown)
        seen += "--set KEY.PATH=VALUE" in shown
    assert seen >= 3  # run, sweep, bench model


@pytest.mark.parametrize(
    "sets, named",
    [
        (["federated.server.lr=1e-3"], {"federated.server.lr": "0.001"}),
        (["federated.server.lr=.001"], {"federated.server.lr": "0.001"}),
        (["federated.server.lr=500"], {"federated.server.lr": "500"}),
        (["federated.server={lr: 0.5, beta1: 0.8}"],
         {"federated.server.lr": "0.5", "federated.server.beta1": "0.8"}),
        (["spec_augment.enabled=false", "federated.cohort_size=8"],
         {"spec_augment.enabled": "false", "federated.cohort_size": "8"}),
    ],
)  # fmt: skip
def test_set_values_name_each_override_by_the_value_it_resolved_to(sets, named):
    """Rows and figures name a --set by the recipe's value, spelled one way, and a section set
    whole by the keys it set; the run is the same configuration whichever way it was typed."""
    registry = load_registry()
    config = resolve(registry, "synth-cv-en-ls-seed", "server-adam", "none", 0, sets)
    assert set_values(config.model_dump(mode="json")) == named
    dotted = [f"{key}={value}" for key, value in named.items()]
    again = resolve(registry, "synth-cv-en-ls-seed", "server-adam", "none", 0, dotted)
    assert ran_hash(again.model_dump(mode="json")) == ran_hash(config.model_dump(mode="json"))


def test_cli_version_alone_prints_it():
    out = _cli("--version")  # before a command is asked for
    assert out.exit_code == 0 and out.stdout.strip() == __version__


def test_cli_show_json_and_unknown_name():
    out = _cli("tasks", "show", "synth-cv-en-ls-seed", "--json")
    assert out.exit_code == 0
    data = json.loads(out.stdout)
    assert data["name"] == "synth-cv-en-ls-seed" and data["_source"]["file_sha256"]
    out = _cli("budgets", "show", "no-such-budget")
    assert isinstance(out.exception, UserError)
    assert "unknown budget 'no-such-budget'" in str(out.exception)


def test_cli_usage_errors_exit_2_without_traceback():
    # Usage errors are the CLI framework's own (exit 2, a message, no exception); a UserError is
    # turned into one by the installed command, so that case runs in a real process.
    for args in (
        ["tasks", "show"],  # missing argument
        ["privacy", "epsilon", "--noise-multiplier", "abc", "--sampling-rate", "0.1"],
    ):
        out = _cli(*args)
        assert out.exit_code == 2 and isinstance(out.exception, SystemExit), args
        assert "Traceback" not in out.output
    out = _process("budgets", "show", "no-such-budget")  # a UserError
    assert out.returncode == 2 and "unknown budget 'no-such-budget'" in out.stderr
    assert "Traceback" not in out.stderr


def test_default_budget_is_the_tasks_first_for_clipping_federated_baselines():
    registry = load_registry()
    task = "synth-cv-en-ls-seed"
    first = registry.task(task).spec.budgets[0]
    assert registry.budget(first).spec.dp
    assert default_budget(registry, task, "perlayer-dim", []) == first
    assert default_budget(registry, task, "global", []) == first
    for baseline in ("fedavg", "seed-only", "central"):  # nothing a DP budget could apply to
        assert default_budget(registry, task, baseline, []) == "none"
    sets = ["privacy.clipping=none"]
    assert default_budget(registry, task, "perlayer-dim", sets) == "none"
    assert default_budget(registry, "cv-en-ls100-seed", "perlayer-dim", []) == "none"


def test_specs_hashes_writes_the_golden_file(tmp_path):
    out = tmp_path / "hashes.json"
    result = CliRunner().invoke(app, ["specs", "hashes", "--write", str(out)])
    assert result.exit_code == 0, result.output
    golden = Path(__file__).parent / "fixtures" / "task_config_hashes.json"
    assert out.read_text() == golden.read_text()
