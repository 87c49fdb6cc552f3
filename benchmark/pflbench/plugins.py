"""Plug-ins: code from outside pflbench that registers methods (client algorithms, server
optimizers, privacy mechanisms, accountants, corpora) in the extension points
(pflbench.extension).

A plug-in is a Python file or an importable module, named by `--plugin PATH_OR_MODULE`
(repeatable), by PFLBENCH_PLUGINS (os.pathsep-separated) or by an installed distribution's entry
point in the group `pflbench.plugins`. Importing it registers its entries; nothing else is
required of it. A plug-in may set `__version__`. Its name (a file's stem, or the module's name)
identifies it in records, so two plug-ins of one name are refused.

Its source, digested, is every file of its code: a module's whole top-level package (a module
`my_pkg.methods` runs `my_pkg.core` too); a file (or a module outside a package) with the modules
of its own folder that its code imports (a helper beside it), as its import statements say. A
file plug-in's folder goes first on sys.path, as for a script.

Every run's record names each plug-in loaded (name, version, sha256 of its source files, what it
registered); `pflbench submit` refuses a record whose plug-ins are not loaded with the same source,
and the leaderboard marks the rows that used one.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pflbench.data.adapters import CORPORA
from pflbench.errors import UserError
from pflbench.extension import ExtensionPoint, registering_as
from pflbench.fl.algorithms import CLIENT_ALGORITHMS
from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS
from pflbench.privacy.accountants import ACCOUNTANTS
from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS

ENTRY_POINT_GROUP = "pflbench.plugins"
ENV = "PFLBENCH_PLUGINS"
EXTENSION_POINTS: tuple[ExtensionPoint, ...] = (
    CORPORA,
    SERVER_OPTIMIZERS,
    ACCOUNTANTS,
    CLIENT_ALGORITHMS,
    PRIVACY_MECHANISMS,
)


@dataclass(frozen=True)
class Plugin:
    name: str  # the module name, or the file's stem
    version: str | None
    sha256: str  # of its source files (names and bytes), sorted by relative path
    source: str  # the path or module as given, or "entry point <name>"
    registered: dict[str, list[str]] = field(default_factory=dict)  # kind -> names

    def record(self) -> dict:
        return asdict(self)


_loaded: dict[str, Plugin] = {}  # by name, in load order
_identity: dict[str, str] = {}  # name -> the resolved file or the module it was loaded from


def source_digest(files: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


def _source_files(module, from_file: bool) -> tuple[list[Path], Path]:
    """The plug-in's code (module docstring) and the folder its paths are relative to."""
    file = Path(getattr(module, "__file__", "") or "")
    if not file.is_file():
        raise UserError(f"plug-in {module.__name__!r} has no source file to digest")
    if not from_file:
        top = sys.modules[module.__name__.partition(".")[0]]
        top_file = Path(getattr(top, "__file__", "") or "")
        if top_file.name == "__init__.py":  # a package: every .py file under it
            return sorted(top_file.parent.rglob("*.py")), top_file.parent
    file = file.resolve()
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix)}
    if installed & set(file.parents):  # an installed module's neighbours are other packages
        return [file], file.parent
    return sorted({file, *_helpers_beside(file)}), file.parent


def _helpers_beside(file: Path) -> set[Path]:
    """The modules of `file`'s folder that its code imports, at module level or inside a function,
    and theirs in turn: read from the import statements (not from what an import brought into
    sys.modules), so a helper two plug-ins share is in both digests whichever loads first."""
    root, found, todo = file.parent, set(), [file]
    while todo:
        try:
            tree = ast.parse(todo.pop().read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue  # the import itself would have failed: nothing to digest
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.partition(".")[0] for name in names} - {"pflbench"}:
                package, module = root / top, root / f"{top}.py"
                # (a folder without __init__.py imports too, as a namespace package)
                paths = package.rglob("*.py") if package.is_dir() else []
                for path in {*paths, *([module] if module.is_file() else [])}:
                    if path.resolve() not in found:
                        found.add(path.resolve())
                        todo.append(path)
    return found - {file}


def _is_file(spec: str) -> bool:
    return spec.endswith(".py") or Path(spec).is_file()


def plugin_name(spec: str) -> str:
    """A --plugin value's name: a file's stem, or the module name."""
    return Path(spec).stem if _is_file(spec) else spec


def _identity_of(spec: str) -> str:
    return f"file {Path(spec).resolve()}" if _is_file(spec) else f"module {spec}"


def _import(spec: str):
    """The module a --plugin value names: a .py file's path, or an importable module name."""
    if not _is_file(spec):
        return importlib.import_module(spec)
    path = Path(spec)
    if not path.is_file():
        raise UserError("no such file")
    if path.suffix != ".py":  # importlib finds no loader for it
        raise UserError("not a .py file (a plug-in is a .py file or an importable module name)")
    # As `python file.py` would: the file's folder first on sys.path, so that a helper beside it
    # imports (at module level or later, inside a function).
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(f"pflbench_plugin_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module


def load_plugin(spec: str, source: str | None = None) -> Plugin:
    """Imports one plug-in (once: loading it again returns the first load) and records what it
    registered. A plug-in that fails to import is an error naming it and the failure."""
    name, identity = plugin_name(spec), _identity_of(spec)
    if name in _loaded:
        if _identity.get(name) == identity:
            return _loaded[name]
        raise UserError(
            f"plug-ins {_loaded[name].source} and {spec} are both named {name!r}, and a record "
            "names its plug-ins by name: rename one"
        )
    origin = f"plug-in {name}"
    try:
        with registering_as(origin):
            module = _import(spec)
    except UserError as exc:
        raise UserError(f"plug-in {spec}: {exc}") from exc
    except (Exception, SystemExit) as exc:  # a researcher's code: say which and what went wrong
        raise UserError(f"plug-in {spec}: failed to load ({type(exc).__name__}: {exc})") from exc
    files, root = _source_files(module, _is_file(spec))
    registered = {
        point.kind: names
        for point in EXTENSION_POINTS
        if (names := sorted(n for n, o in point.origins.items() if o == origin))
    }
    version = getattr(module, "__version__", None)
    plugin = Plugin(name, str(version) if version is not None else None,
                    source_digest(files, root), source or spec, registered)  # fmt: skip
    _loaded[name], _identity[name] = plugin, identity
    return plugin


def load_plugins(given: list[str] | None = None) -> list[Plugin]:
    """Entry points of installed distributions, then PFLBENCH_PLUGINS, then `given`
    (--plugin); returns every plug-in loaded in this process."""
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        load_plugin(entry.module, source=f"entry point {entry.name}")
    for spec in filter(None, os.environ.get(ENV, "").split(os.pathsep)):
        load_plugin(spec)
    for spec in given or []:
        load_plugin(spec)
    return loaded_plugins()


def loaded_plugins() -> list[Plugin]:
    return list(_loaded.values())


def check_record_plugins(recorded: list[dict], where: str) -> None:
    """A record's plug-ins are loaded here, with the same source: else UserError naming them."""
    for entry in recorded:
        name, digest = entry.get("name"), entry.get("sha256")
        here = _loaded.get(name)
        if here is None:
            raise UserError(
                f"{where}: the run used plug-in {name!r} (version {entry.get('version')}, source "
                f"sha256 {digest}), which is not loaded; load it with --plugin "
                f"{entry.get('source') or 'PATH_OR_MODULE'} (or {ENV}) to check the record"
            )
        if here.sha256 != digest:
            raise UserError(
                f"{where}: plug-in {name!r} loaded from {here.source} has source sha256 "
                f"{here.sha256}, but the run used sha256 {digest}: not the code that produced it"
            )
