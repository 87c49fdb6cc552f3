"""Extension points: a named registry per kind of pluggable method (corpora, server optimizers,
accountants, client algorithms, privacy mechanisms), which built-in modules and plug-ins
(pflbench.plugins) fill.

An `ExtensionPoint` is a dict from name to entry, changed only by `register`. Looking up a name it
lacks raises a UserError that lists the known names; registering a name twice is refused, naming
who registered it first.
Each name remembers its origin ("built-in", or the plug-in being loaded), so that a run's record
can say which of its methods came from outside pflbench. Specs hold names only (pflbench.spec is
pure data); pflbench.methods checks a spec's names against these registries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pflbench.errors import UserError

BUILTIN = "built-in"
_loading: list[str] = []  # the plug-in whose module is being imported (pflbench.plugins)


@contextmanager
def registering_as(origin: str) -> Iterator[None]:
    """Entries registered inside the block have `origin` (a plug-in's name)."""
    _loading.append(origin)
    try:
        yield
    finally:
        _loading.pop()


class ExtensionPoint(dict):
    """name -> entry for one kind of method; see the module docstring."""

    def __init__(
        self,
        kind: str,
        entries: Iterable[tuple[str, Any]] = (),
        *,
        entry_type: type | None = None,
        classes: bool = False,
    ) -> None:
        """`entry_type`: what an entry must be, an instance of it (or with `classes`, a
        subclass): a wrong entry is refused at registration, naming its plug-in, rather than
        failing wherever a run first uses it."""
        super().__init__()
        self.kind = kind
        self.entry_type, self.classes = entry_type, classes
        self.origins: dict[str, str] = {}
        for name, entry in entries:
            self.register(name, entry)

    def register(self, name: str, entry: Any = None) -> Any:
        """Registers `entry` as `name`; without an entry, a decorator that registers what it
        decorates. A name already registered is refused."""
        if entry is None:

            def decorate(obj: Callable) -> Callable:
                self.register(name, obj)
                return obj

            return decorate
        if not isinstance(name, str) or not name:
            raise UserError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        if name in self:
            first = self.origins.get(name, BUILTIN)
            raise UserError(
                f"{self.kind} {name!r} is already registered (by {first}); choose another name"
            )
        wanted = self.entry_type
        if wanted is not None:
            fits = issubclass(entry, wanted) if isinstance(entry, type) else False
            if not (fits if self.classes else isinstance(entry, wanted)):
                what = (
                    f"a subclass of {wanted.__name__}" if self.classes else f"a {wanted.__name__}"
                )
                origin = _loading[-1] if _loading else BUILTIN
                raise UserError(f"{self.kind} {name!r} ({origin}) must be {what}, got {entry!r}")
        super().__setitem__(name, entry)
        self.origins[name] = _loading[-1] if _loading else BUILTIN
        return entry

    def _refuse_change(self, *args, **kwargs) -> None:
        raise UserError(
            f"the {self.kind} registry changes only by register(name, entry), which refuses a "
            "name registered twice (an assignment would replace a method unrecorded)"
        )

    __setitem__ = __delitem__ = __ior__ = _refuse_change
    update = setdefault = pop = popitem = clear = _refuse_change

    def __missing__(self, name: str) -> Any:
        raise UserError(
            f"unknown {self.kind} {name!r}; known: {', '.join(self) or 'none'} "
            "(plug-ins add more: --plugin, PFLBENCH_PLUGINS)"
        )

    def from_plugins(self) -> dict[str, str]:
        """name -> plug-in, for the entries that plug-ins registered."""
        return {n: o for n, o in self.origins.items() if o != BUILTIN}

    def origin_of_unshipped(self, name: str) -> str:
        """Where an entry pflbench does not ship came from, for messages: its plug-in, or other
        code that registered it without the plug-in loader (its origin then reads built-in)."""
        origin = self.origins.get(name, BUILTIN)
        return "registered outside a plug-in" if origin == BUILTIN else origin
