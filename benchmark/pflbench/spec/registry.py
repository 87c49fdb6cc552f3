"""Finding and loading specs: built-in tasks/, baselines/ and tasks/budgets.yaml, plus user folders.

A user folder has the same layout as the built-in one (`DIR/tasks/*.yaml`, `DIR/baselines/*.yaml`,
`DIR/tasks/budgets.yaml`, the templates task files include in `DIR/tasks/templates/`); its specs
appear next to the built-in ones and a name clash is an error naming both files.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pflbench.errors import UserError
from pflbench.spec.models import Baseline, Budget, Recipe, Task

BUDGETS_FILE = "budgets.yaml"
M = TypeVar("M", bound=BaseModel)


# ----------------------------------------------------------------------------------------------
# YAML with duplicate keys rejected (PyYAML silently keeps the last one), and with YAML 1.2's
# floats: PyYAML (YAML 1.1) reads `1e-3`, without a dot, as a string, which a typed field converts
# but a plug-in's options (a free mapping) would keep, so that `lr: 1e-3` and `lr: 0.001` were two
# configurations of one run. pflbench writes YAML by the same rule (`dump_yaml`: the string
# "1e-3" quoted), so what it writes reads back as it was.


class _StrictLoader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


for _yaml_class in (_StrictLoader, _Dumper):
    _yaml_class.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys one may override
            continue
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates
)


def load_yaml(text: str | bytes) -> Any:
    """YAML as pflbench reads every spec, sweep and --set value (the loader above)."""
    return yaml.load(text, Loader=_StrictLoader)


def dump_yaml(data: Any, **options) -> str:
    """`data` as YAML that `load_yaml` reads back as it is (`options`: yaml.dump's)."""
    return yaml.dump(data, Dumper=_Dumper, allow_unicode=True, **options)


def read_yaml(path: Path) -> tuple[Any, bytes]:
    try:
        data = path.read_bytes()
    except OSError as exc:  # a folder named x.yaml, a dangling link, no permission
        raise UserError(f"{path}: cannot read the spec file: {exc.strerror}") from None
    try:
        return load_yaml(data), data
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML: {exc}") from None


def format_validation_error(where: str, exc: ValidationError) -> str:
    lines = [f"{where}: invalid spec"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; unknown keys are not ignored)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"  {key}: {msg}" + _got(err))
    return "\n".join(lines)


def _got(err: dict) -> str:
    if err["type"] in ("missing", "extra_forbidden") or "input" not in err:
        return ""
    value = repr(err["input"])
    return f" (got {value[:60]})"


def validate(model: type[M], data: Any, where: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(where, exc)) from None


# ----------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class Loaded(Generic[M]):
    spec: M
    path: Path
    sha256: str


@dataclass
class Registry:
    tasks: dict[str, Loaded[Task]] = field(default_factory=dict)
    baselines: dict[str, Loaded[Baseline]] = field(default_factory=dict)
    budgets: dict[str, Loaded[Budget]] = field(default_factory=dict)

    def task(self, name: str) -> Loaded[Task]:
        return _lookup(self.tasks, name, "task")

    def baseline(self, name: str) -> Loaded[Baseline]:
        return _lookup(self.baselines, name, "baseline")

    def budget(self, name: str) -> Loaded[Budget]:
        return _lookup(self.budgets, name, "budget")


def _lookup(table: dict[str, Loaded], name: str, kind: str) -> Loaded:
    if name not in table:
        known = ", ".join(sorted(table)) or "(none)"
        raise UserError(
            f"unknown {kind} {name!r}; known {kind}s: {known} (specs from outside the repository:"
            " --specs FOLDER or PFLBENCH_SPECS)"
        )
    return table[name]


def builtin_spec_root() -> tuple[Path, Path]:
    """(tasks dir, baselines dir): the checkout's top-level folders, else the installed copies."""
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "tasks").is_dir() and (checkout / "baselines").is_dir():
        return checkout / "tasks", checkout / "baselines"
    pkg = resources.files("pflbench") / "specs"
    return Path(str(pkg / "tasks")), Path(str(pkg / "baselines"))


def _add(table: dict[str, Loaded], loaded: Loaded, kind: str) -> None:
    name = loaded.spec.name
    if name in table:
        raise UserError(
            f"{kind} {name!r} is defined twice: in {table[name].path} and in {loaded.path}"
        )
    table[name] = loaded


def read_task_yaml(path: Path) -> tuple[Any, str]:
    """A task file with its `include:` templates merged in, and the sha256 of all those bytes.

    `include: [templates/x.yaml, ...]` names files relative to the task file; they are
    deep-merged in order (later wins), then the task file's own keys over them (lists, such as
    eval_sets, are replaced whole). Templates cannot include further templates."""
    from pflbench.spec.resolve import deep_merge

    data, raw = read_yaml(path)
    digest = hashlib.sha256(raw)
    if not isinstance(data, dict) or "include" not in data:
        return data, digest.hexdigest()
    names = data.pop("include")
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{path}: include: expected a list of template file paths")
    merged: dict = {}
    for name in names:
        template = path.parent / name
        if not template.is_file():
            raise UserError(f"{path}: include: template {template} does not exist")
        part, part_raw = read_yaml(template)
        if not isinstance(part, dict):
            raise UserError(f"{template}: a template must be a mapping of task keys")
        if "include" in part:
            raise UserError(f"{template}: templates cannot include other templates")
        digest.update(part_raw)
        merged = deep_merge(merged, part)
    return deep_merge(merged, data), digest.hexdigest()


def _spec_files(folder: Path) -> list[Path]:
    """The `*.yaml` files of a spec folder. Another spelling of the extension (`.yml`, `.YAML`) is
    an error rather than skipped, so that no spec is silently left out."""
    if not folder.exists():
        return []
    if not folder.is_dir():
        raise UserError(f"{folder}: expected a folder of *.yaml specs, found a file")
    paths = sorted(folder.iterdir())
    for path in paths:
        if path.suffix.lower() in (".yaml", ".yml") and path.suffix != ".yaml":
            raise UserError(f"{path}: spec files must end in .yaml (rename it to {path.stem}.yaml)")
    return [path for path in paths if path.suffix == ".yaml"]


def _load_dir(reg: Registry, tasks_dir: Path, baselines_dir: Path) -> None:
    for path in _spec_files(tasks_dir):
        if path.name == BUDGETS_FILE:
            data, raw = read_yaml(path)
            digest = hashlib.sha256(raw).hexdigest()
            if not isinstance(data, dict) or not isinstance(data.get("budgets"), list):
                raise UserError(f"{path}: expected a top-level key 'budgets' holding a list")
            for i, item in enumerate(data["budgets"]):
                spec = validate(Budget, item, f"{path}: budgets[{i}]")
                _add(reg.budgets, Loaded(spec, path, digest), "budget")
            continue
        data, digest = read_task_yaml(path)
        _add(reg.tasks, Loaded(validate(Task, data, str(path)), path, digest), "task")
    for path in _spec_files(baselines_dir):
        data, raw = read_yaml(path)
        spec = validate(Baseline, data, str(path))
        check_overrides(spec.overrides, str(path))
        _add(reg.baselines, Loaded(spec, path, hashlib.sha256(raw).hexdigest()), "baseline")


def check_overrides(overrides: dict, where: str) -> None:
    """A baseline's overrides must name real recipe keys with valid values."""
    from pflbench.spec.resolve import deep_merge

    validate(Recipe, deep_merge(Recipe().model_dump(), overrides), f"{where}: overrides")


def load_registry(extra_dirs: list[Path] | None = None) -> Registry:
    reg = Registry()
    _load_dir(reg, *builtin_spec_root())
    for d in extra_dirs or []:
        d = Path(d)
        if not d.is_dir():
            raise UserError(f"--specs {d}: not a folder")
        if not (d / "tasks").is_dir() and not (d / "baselines").is_dir():
            raise UserError(
                f"--specs {d}: expected subfolders tasks/ and/or baselines/ "
                "(the same layout as the built-in specs)"
            )
        _load_dir(reg, d / "tasks", d / "baselines")
    check_references(reg)
    return reg


def check_references(reg: Registry) -> None:
    """Names a spec refers to (a task's budgets, a budget's matched paper budget) must exist."""
    for loaded in reg.tasks.values():
        for name in loaded.spec.budgets:
            if name not in reg.budgets:
                raise UserError(f"{loaded.path}: budgets names {name!r}, which is not a budget")
    for loaded in reg.budgets.values():
        match = loaded.spec.matches
        if match is not None and match not in reg.budgets:
            raise UserError(f"{loaded.path}: budget {loaded.spec.name!r} matches unknown {match!r}")
