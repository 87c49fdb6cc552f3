"""The package graph is a DAG with layers that point one way: spec (pure data) at the bottom, then
data/model/privacy, then fl and central training, then runner/results/plug-ins, then the CLI. Every
import counts, including those inside functions and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import pflbench

ROOT = Path(pflbench.__file__).parent

# Top-level module or package of pflbench -> its layer. A module may import its own layer or a
# lower one (and the graph of top-level units must stay acyclic), never a higher one.
LAYERS = {
    "__init__": 0, "errors": 0, "seeds": 0, "files": 0, "digests": 0, "extension": 0,
    "progress": 0, "spec": 0,
    "data": 1, "model": 1, "checkpoint": 1, "numerics": 1, "privacy": 1, "evaluate": 1,
    "fl": 2, "central": 2, "dpsgd": 2,
    "runner": 3, "rundir": 3, "metrics_log": 3, "results": 3, "methods": 3, "plugins": 3,
    "cli": 4, "__main__": 4,
}  # fmt: skip


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "pflbench":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(source: str, rel: Path) -> set[str]:
    """Every module the source of pflbench/`rel` imports: `import a.b`, `from a import b`
    (a.b: b may be a module), relative imports resolved against the file's package, and
    importlib.import_module("...") of a constant name."""
    package = ["pflbench", *rel.parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def imports() -> dict[str, set[tuple[str, str]]]:
    """unit -> {(imported unit, file)} over every import in pflbench."""
    edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for file in ROOT.rglob("*.py"):
        rel = file.relative_to(ROOT)
        unit = rel.parts[0].removesuffix(".py")
        for name in imported_modules(file.read_text(), rel):
            target = unit_of(name)
            # `from pflbench.x import y` also yields pflbench.x.y; a name y that is no unit of
            # pflbench's top level (a function of __init__) is not an edge of its own.
            if target is not None and target != unit and target in LAYERS:
                edges[unit].add((target, str(rel)))
    return edges


def test_every_import_form_is_seen():
    source = """
import pflbench.runner
from pflbench import cli
from pflbench.results.record import ResultRecord
from .. import fl
from ...central import train_central
from . import sibling
importlib.import_module("pflbench.plugins")
def f():
    from pflbench.methods import x
"""
    units = {unit_of(m) for m in imported_modules(source, Path("privacy/mechanisms/base.py"))}
    assert {"runner", "cli", "results", "central", "plugins", "methods"} <= units
    # `from .. import fl` in privacy/mechanisms/ is pflbench.privacy.fl (no such module: not
    # a cross-unit edge); `from ... import fl` would be pflbench.fl
    assert "pflbench.privacy.fl" in imported_modules(source, Path("privacy/mechanisms/base.py"))
    assert "pflbench.fl" in imported_modules("from ... import fl", Path("privacy/mechanisms/b.py"))


def test_every_unit_has_a_layer():
    units = {p.name.removesuffix(".py") for p in ROOT.iterdir() if p.suffix == ".py" or (
        p.is_dir() and (p / "__init__.py").is_file())}  # fmt: skip
    assert units == set(LAYERS), f"give these a layer: {sorted(units ^ set(LAYERS))}"


def test_no_import_points_up():
    upward = sorted(
        f"{file} imports pflbench.{target} (layer {LAYERS[target]} > {LAYERS[unit]})"
        for unit, targets in imports().items()
        for target, file in targets
        if LAYERS[target] > LAYERS[unit]
    )
    assert not upward, "\n".join(upward)


def test_the_package_graph_is_acyclic():
    graph = {unit: {t for t, _ in targets} for unit, targets in imports().items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target] if target in path else [unit, target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state.get(target) is None:
                visit(target, path + [target])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [unit])


def test_spec_imports_nothing_above_it():
    for target, file in imports().get("spec", ()):
        assert LAYERS[target] == 0, f"{file} imports pflbench.{target}"


def test_every_module_imports():
    """A name moved between modules is caught here even where no other test imports it."""
    import importlib
    import pkgutil

    for module in pkgutil.walk_packages([str(ROOT)], "pflbench."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
