"""Task, baseline and budget names as records and run directories use them: checked before a name
from a record becomes a path component."""

from __future__ import annotations

import re

from pflbench.errors import UserError

NAME_PATTERN = r"^[a-z0-9][a-z0-9.\-]{0,99}$"  # task / baseline / budget names (as in the specs)


def safe_name(name: str, what: str) -> str:
    """A name from a record, checked before it becomes a path component (no '/', '..', '~')."""
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise UserError(
            f"{what} {name!r} is not a safe name: expected lowercase letters, digits, '.', '-' "
            "starting with a letter or digit (it becomes a folder name under results/)"
        )
    return name
