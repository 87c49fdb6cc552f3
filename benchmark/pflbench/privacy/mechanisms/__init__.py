"""Privacy mechanisms (privacy.mechanisms.base: the interface, the registry and the Gaussian
mechanism). Every other module of this package is one more built-in mechanism that registers
itself, imported here: adding one is adding its module, nothing else."""

from __future__ import annotations

import importlib
import pkgutil

from pflbench.privacy.mechanisms.base import (
    PRIVACY_MECHANISMS,
    MechanismContext,
    PrivacyMechanism,
    check_mechanism_recipe,
    check_noise_on_average,
    check_within_clip_bound,
    checks_plugin_bound,
    mechanism_class,
    scales_in_sum,
)

__all__ = [
    "PRIVACY_MECHANISMS",
    "MechanismContext",
    "PrivacyMechanism",
    "check_mechanism_recipe",
    "check_noise_on_average",
    "check_within_clip_bound",
    "checks_plugin_bound",
    "mechanism_class",
    "scales_in_sum",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
