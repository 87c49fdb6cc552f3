"""State a user keeps between the central steps it takes part in (a client algorithm's, e.g.
SCAFFOLD's control variate), on disk so that memory does not grow with the population.

One safetensors file per user and version: `<root>/<user key>/<step>.safetensors` is the state
the user left at central step `step`. Reading at step t takes the newest version written before
t. Versions are never overwritten, so a run resumed from its checkpoint at step t first drops
every version from step ≥ t (what the killed process wrote after the checkpoint) and then reads
exactly what the uninterrupted run read. Processes of one run share the folder: a user's state is
written by whichever process trains it, before the step's all-reduce, and read by any afterwards.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pflbench.errors import UserError
from pflbench.files import atomic_write


class UserStateStore:
    """Versioned per-user tensors under `root` (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._sealed = False

    @contextmanager
    def sealed(self) -> Iterator[None]:
        """While the server steps: a user's state is the client's (raw, not privatized), so
        loading or saving it is refused there (the server gets the privatized average only)."""
        self._sealed = True
        try:
            yield
        finally:
            self._sealed = False

    def _check_open(self) -> None:
        if self._sealed:
            raise UserError(
                "a client algorithm read or wrote a user's state in its server_step: that state"
                " is the client's, not privatized, and the server sees only the privatized"
                " average (read it in the client hooks: start_group, payload)"
            )

    def _folder(self, user: str) -> Path:
        # User ids are free text (Common Voice client ids, plug-in corpora): hash them to a name.
        return self.root / hashlib.sha256(user.encode()).hexdigest()[:24]

    def load(self, user: str, step: int) -> dict[str, torch.Tensor] | None:
        """The user's newest state written before central step `step`, or None."""
        self._check_open()
        versions = [v for v in self._versions(self._folder(user)) if v < step]
        if not versions:
            return None
        return load_file(self._folder(user) / f"{max(versions):07d}.safetensors")

    def save(self, user: str, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """The state the user leaves at central step `step`."""
        self._check_open()
        folder = self._folder(user)
        folder.mkdir(parents=True, exist_ok=True)
        contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        atomic_write(folder / f"{step:07d}.safetensors", lambda tmp: save_file(contiguous, tmp))

    def rewind(self, step: int) -> None:
        """Drop every version from step ≥ `step`: resuming at `step` reads what the run did."""
        for folder in self._folders():
            for version in self._versions(folder):
                if version >= step:
                    (folder / f"{version:07d}.safetensors").unlink(missing_ok=True)

    def prune(self, step: int) -> None:
        """Keep what a resume at `step` or later can read: per user the newest version before
        `step` and every later one."""
        for folder in self._folders():
            older = sorted(v for v in self._versions(folder) if v < step)
            for version in older[:-1]:
                (folder / f"{version:07d}.safetensors").unlink(missing_ok=True)

    def clear(self) -> None:
        """Drop every version: after a run's last step no resume reads any. (A folder that
        cannot be deleted raises: its disk would stay taken unnoticed.)"""
        if self.root.is_dir():
            shutil.rmtree(self.root)

    def _folders(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.is_dir()] if self.root.is_dir() else []

    @staticmethod
    def _versions(folder: Path) -> list[int]:
        if not folder.is_dir():
            return []
        return [int(p.stem) for p in folder.glob("*.safetensors") if p.stem.isdigit()]
