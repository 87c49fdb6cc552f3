"""Bad user spec folders (`--specs DIR`) fail with a UserError naming the file and the problem,
never a silent conversion, a skipped file or a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_spec import TASK, _spec_dir
from typer.testing import CliRunner

from pflbench.cli import app, main
from pflbench.errors import UserError
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import resolve

BASELINE = """\
name: my-baseline
description: x
reproduces: y
"""
BUDGET = {
    "name": "my-budget",
    "epsilon": "2.0",
    "delta": "1.0e-6",
    "population": "1000",
    "cohort": "10",
    "steps": "5",
}


def _baseline(overrides: str) -> dict[str, str]:
    return {"baselines/my-baseline.yaml": BASELINE + f"overrides: {overrides}\n"}


def _budgets(**fields: str) -> dict[str, str]:
    """tasks/budgets.yaml holding BUDGET with `fields` (YAML values) set over it."""
    budget = ", ".join(f"{key}: {value}" for key, value in {**BUDGET, **fields}.items())
    return {"tasks/budgets.yaml": f"budgets: [{{{budget}}}]\n"}


def _refused(files: dict[str, str], root: Path, needles: list[str]) -> str:
    """Loading the folder raises a UserError holding every needle; the CLI raises the same."""
    d = _spec_dir(root, files)
    with pytest.raises(UserError) as info:
        load_registry([d])
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    out = CliRunner().invoke(app, ["baselines", "list", "--specs", str(d)])
    assert isinstance(out.exception, UserError) and str(out.exception) == message
    return message


# ----------------------------------------------------------------------------------------------
# 1. ints and booleans take only their own YAML type; floats take ints but not booleans


@pytest.mark.parametrize(
    "files, needles",
    [
        (
            _baseline("{federated: {cohort_size: true}}"),
            ["federated.cohort_size: Input should be a valid integer (got True)"],
        ),
        (
            _baseline("{federated: {cohort_size: '8'}}"),
            ["federated.cohort_size: Input should be a valid integer (got '8')"],
        ),
        (
            _baseline("{federated: {central_steps: 8.0}}"),
            ["federated.central_steps: Input should be a valid integer (got 8.0)"],
        ),
        (
            _baseline("{federated: {client: {lr: true}}}"),
            ["federated.client.lr: Value error, expected a number, not true/false"],
        ),
        (
            _baseline("{spec_augment: {enabled: 1}}"),
            ["spec_augment.enabled: Input should be a valid boolean"],
        ),
        (
            {"tasks/t.yaml": TASK.replace("version: 1", "version: true")},
            ["t.yaml", "version: Input should be a valid integer (got True)"],
        ),
        (
            {"tasks/t.yaml": TASK + "synthetic: {seed: false}\n"},
            ["t.yaml", "synthetic.seed: Input should be a valid integer"],
        ),
        (
            _budgets(population="true"),
            ["budgets[0]", "population: Input should be a valid integer"],
        ),
        (
            _budgets(epsilon="true"),
            ["budgets[0]", "epsilon: Value error, expected a number, not true/false"],
        ),
        (
            {"tasks/budgets.yaml": "budgets: [{name: no-noise, dp: 0}]\n"},
            ["budgets[0]", "dp: Input should be a valid boolean"],
        ),
    ],
)
def test_booleans_and_strings_are_not_numbers(tmp_path, files, needles):
    (rel,) = files
    _refused(files, tmp_path, [str(tmp_path / rel), *needles])


def test_float_fields_take_yaml_ints_as_floats(tmp_path):
    d = _spec_dir(
        tmp_path,
        {
            "tasks/t.yaml": TASK,
            **_budgets(epsilon="2"),
            **_baseline("{federated: {client: {lr: 1}}, privacy: {clip_bound: 1e-3}}"),
        },
    )
    registry = load_registry([d])
    assert registry.budget("my-budget").spec.epsilon == 2.0
    config = resolve(registry, "my-task", "my-baseline")
    lr = config.recipe.federated.client.lr
    assert lr == 1.0 and isinstance(lr, float)
    # PyYAML reads `1e-3` (no dot) as a string; a float field still takes it as the number.
    assert config.recipe.privacy.clip_bound == 0.001


# ----------------------------------------------------------------------------------------------
# 2. every float is finite


@pytest.mark.parametrize(
    "files, needles",
    [
        (_budgets(epsilon=".inf"), ["budgets[0]", "epsilon", "finite number"]),
        (_budgets(epsilon=".nan"), ["budgets[0]", "epsilon", "finite number"]),
        (_budgets(delta=".nan"), ["budgets[0]", "delta", "finite number"]),
        (_baseline("{privacy: {clip_bound: .inf}}"), ["privacy.clip_bound", "finite number"]),
        (_baseline("{federated: {client: {lr: .inf}}}"), ["client.lr", "finite number"]),
        (
            {"tasks/t.yaml": TASK + "recipe: {central: {lr: .inf}}\n"},
            ["t.yaml", "recipe.central.lr", "finite number"],
        ),
    ],
)
def test_infinite_and_nan_floats_are_refused(tmp_path, files, needles):
    _refused(files, tmp_path, needles)


def test_a_user_budgets_delta_must_be_below_one_over_its_population(tmp_path):
    """At δ >= 1/K, releasing one random user's data verbatim meets (0, δ)-DP: a void claim."""
    _refused(
        _budgets(delta="0.001", population="1000"),
        tmp_path,
        ["budgets[0]", "delta 0.001 must be below 1/population = 0.001"],
    )
    d = _spec_dir(tmp_path / "ok", _budgets(delta="0.000999", population="1000"))
    assert load_registry([d]).budget("my-budget").spec.delta == 0.000999


def test_set_refuses_an_infinite_value(tmp_path):
    d = _spec_dir(tmp_path, {"tasks/t.yaml": TASK, **_baseline("{}")})
    with pytest.raises(UserError, match=r"privacy\.clip_bound: Input should be a finite number"):
        resolve(load_registry([d]), "my-task", "my-baseline", sets=["privacy.clip_bound=.inf"])


# ----------------------------------------------------------------------------------------------
# 3.-5. files that are no spec: a folder, another extension, a YAML tag that runs code


@pytest.mark.parametrize("folder", ["baselines", "tasks"])
def test_a_folder_named_like_a_spec_is_an_error(tmp_path, folder):
    (tmp_path / folder / "foo.yaml").mkdir(parents=True)
    _refused({}, tmp_path, [str(tmp_path / folder / "foo.yaml"), "Is a directory"])


@pytest.mark.parametrize(
    "rel, text",
    [
        ("baselines/my-baseline.yml", BASELINE),
        ("baselines/my-baseline.YAML", BASELINE),
        ("tasks/my-task.yml", TASK),
        ("tasks/budgets.yml", _budgets()["tasks/budgets.yaml"]),
    ],
)
def test_other_yaml_extensions_are_refused_not_skipped(tmp_path, rel, text):
    message = _refused({rel: text}, tmp_path, [str(tmp_path / rel), "must end in .yaml"])
    assert Path(rel).stem + ".yaml" in message


def test_python_tags_are_not_valid_yaml(tmp_path):
    marker = tmp_path / "ran"
    files = {
        "baselines/evil.yaml": f"name: !!python/object/apply:os.system ['touch {marker}']\n"
        "description: x\nreproduces: y\n"
    }
    _refused(
        files, tmp_path, [str(tmp_path / "baselines/evil.yaml"), "not valid YAML", "python/object"]
    )
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# The command's entry point: exit code 2, the file and the problem on stderr, no traceback


# In this process (the installed command in its own process: tests/test_spec.py): the listing and
# the hashing commands load specs the same way, so the cases alternate between them.
@pytest.mark.parametrize(
    "files, args, needle",
    [
        (
            _baseline("{federated: {cohort_size: true}}"),
            ["baselines", "list"],
            "federated.cohort_size",
        ),
        (_budgets(epsilon=".inf"), ["specs", "hashes"], "finite number"),
        ({"baselines/foo.yaml/.keep": ""}, ["specs", "hashes"], "foo.yaml: cannot read"),
        ({"baselines/my-baseline.yml": BASELINE}, ["baselines", "list"], "must end in .yaml"),
    ],
)
def test_cli_exits_2_without_traceback(tmp_path, files, args, needle, capsys, monkeypatch):
    d = _spec_dir(tmp_path, files)
    monkeypatch.setattr(sys, "argv", ["pflbench", *args, "--specs", str(d)])
    with pytest.raises(SystemExit) as exited:
        main()
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, (args, stderr)
    assert needle in stderr and str(d) in stderr, stderr
    assert "Traceback" not in stderr


def test_a_file_where_the_tasks_folder_belongs_is_an_error(tmp_path):
    (tmp_path / "baselines").mkdir()
    (tmp_path / "tasks").write_text("name: mytask\n")  # meant as a folder: no spec silently lost
    with pytest.raises(UserError, match=r"tasks: expected a folder of \*.yaml specs, found a file"):
        load_registry([tmp_path])
