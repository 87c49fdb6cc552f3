"""The built wheel ships tasks/, baselines/ and budgets, and a non-editable install finds them
(and the privacy path's C kernels, where a compiler builds them); constraints.txt pins what
`make` installs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pflbench.privacy import clipping

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    # Build from a copy so the checkout gets no build/ or egg-info droppings.
    for name in ("pyproject.toml", "setup.py", "README.md", "benchmark", "tasks", "baselines"):
        path = ROOT / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.so")  # (the build makes its own)
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.exists():
            shutil.copy(path, src / name)
    for suffix in (".safetensors", ".json"):  # a shipped seed model (central.SHIPPED_SEEDS)
        (src / "tasks" / "seed-models" / f"probe-v1-0123456789abcdef{suffix}").write_text("{}")
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    proc = subprocess.run([*cmd, "-w", str(out), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (whl,) = out.glob("pflbench-*.whl")
    return whl


def test_wheel_contains_specs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    prefix = "pflbench/specs/tasks/"
    shipped_tasks = {
        n.removeprefix(prefix) for n in names if n.startswith(prefix) and n.endswith(".yaml")
    }
    tasks = {p.relative_to(ROOT / "tasks").as_posix() for p in (ROOT / "tasks").rglob("*.yaml")}
    assert any(t.startswith("templates/") for t in tasks)  # the templates task files include
    assert tasks == shipped_tasks
    shipped = {Path(n).name for n in names if n.startswith("pflbench/specs/baselines/")}
    assert {p.name for p in (ROOT / "baselines").glob("*.yaml")} == shipped
    seeds = {Path(n).name for n in names if n.startswith(f"{prefix}seed-models/")}
    assert {"probe-v1-0123456789abcdef.safetensors", "probe-v1-0123456789abcdef.json"} <= seeds


def test_non_editable_install_finds_specs(wheel, tmp_path):
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    proc = subprocess.run([*cmd, str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    code = (
        "import json, pflbench, importlib.util; from pflbench.spec.registry import load_registry;"
        "r = load_registry(); kernels = importlib.util.find_spec('pflbench.privacy._kernels');"
        "print(json.dumps([pflbench.__file__, sorted(r.tasks), sorted(r.budgets),"
        " len(r.baselines), kernels and kernels.origin]))"
    )
    # the installed copy first; keep any existing path (where dependencies may live)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr
    module_file, tasks, budgets, n_baselines, kernels = json.loads(proc.stdout)
    assert module_file.startswith(str(target))  # the installed copy, not the checkout
    if clipping._kernels is not None:  # a C compiler here: the wheel's kernels are built too
        assert kernels and kernels.startswith(str(target))
    assert "synth-cv-en-ls-seed" in tasks and "cv-en-ls100-seed" in tasks
    declared = yaml.safe_load((ROOT / "tasks" / "budgets.yaml").read_text())["budgets"]
    assert budgets == sorted(b["name"] for b in declared)
    assert n_baselines == len(list((ROOT / "baselines").glob("*.yaml")))


@pytest.mark.skipif(clipping._kernels is None, reason="no C compiler here: no kernels to build")
def test_the_kernels_build_with_ieee_arithmetic_whatever_cflags_say(tmp_path):
    """CFLAGS=-Ofast (fast math) would fold the kernels' rounding away and link a startup file
    that flushes subnormals to zero in the whole process, torch's numbers included: setup.py
    drops it for the kernels. Built so, they round ties half to even and torch keeps
    subnormals."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "benchmark", tmp_path / "benchmark", ignore=ignore)
    build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    env = {**os.environ, "CFLAGS": "-Ofast"}
    done = subprocess.run(build, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    code = (
        "import json, torch; from pflbench.privacy import _kernels;"
        "ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5]);"
        "out = torch.zeros(5, dtype=torch.float64);"
        "_kernels.add_quantized(ties.data_ptr(), 'f', out.data_ptr(), 5, 1.0, 1.0);"
        "tiny = torch.tensor([1e-310], dtype=torch.float64) * 1;"
        "print(json.dumps([_kernels.__file__, out.tolist(), tiny.item()]))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "benchmark")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    module, rounded, tiny = json.loads(done.stdout)
    assert module.startswith(str(tmp_path))
    assert rounded == [0.0, 2.0, 2.0, 0.0, -2.0] and tiny == 1e-310


def _pins() -> dict[str, str]:
    """constraints.txt as {normalized name: pinned version}; every line must be `name==version`."""
    pins = {}
    for number, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"constraints.txt:{number}: {line!r} does not pin (==) a version"
        pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_dependency():
    """The lock pins (==) every package pyproject.toml names, runtime and extras (`make` installs
    .[dev]), at a version its range admits; torch at its public version, not a local build."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for rs in project["optional-dependencies"].values() for r in rs]
    pins = _pins()
    assert "pflbench" not in pins
    for req in declared:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name]), f"{req.name}=={pins[name]} is not {req}"
    assert "+" not in pins["torch"]


def test_the_installed_command_imports_the_cli_only_when_it_runs():
    # The command's script imports its entry point's module, and every forkserver/spawn child
    # (synthesis starts one per unit of work) imports the parent's main script again: that
    # module must not pull in the CLI (torch, ~2.5 s a child).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    module, function = project["scripts"]["pflbench"].split(":")
    code = f"import sys, {module}; assert callable({module}.{function}); print(sorted(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = done.stdout
    assert "'torch'" not in imported and "'pflbench.cli'" not in imported
