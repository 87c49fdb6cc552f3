"""Client algorithms (fl.algorithms.base: the interface, the registry, FedAvg and its one-hook
variants). Every other module of this package is one more built-in algorithm that registers
itself, imported here: adding one is adding its module, nothing else."""

from __future__ import annotations

import importlib
import pkgutil

from pflbench.fl.algorithms.base import (
    CLIENT_ALGORITHMS,
    AlgorithmContext,
    ClientAlgorithm,
    check_client_recipe,
)

__all__ = ["CLIENT_ALGORITHMS", "AlgorithmContext", "ClientAlgorithm", "check_client_recipe"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
