"""`pflbench bench privacy`: how long the accountants take (printed, never asserted)."""

from __future__ import annotations

import importlib
import time

from pflbench.privacy.accountants import (
    ACCOUNTANTS,
    calibrate_noise,
    calibrating,
    clear_cache,
    compute_epsilon,
)
from pflbench.privacy.accounting import SampledGaussian, sampled_gaussian


def bench_privacy() -> dict:
    """Wall-clock seconds of one epsilon at T=2000 per accountant and one calibration by each
    that calibrates."""
    z, q, steps, delta = 1.0, 0.01, 2000, 1e-9
    start = time.perf_counter()
    for accountant in ACCOUNTANTS.values():  # the accountants import lazily: time it apart
        importlib.import_module(accountant.library)
    times: dict = {"import_libraries_s": time.perf_counter() - start}
    for name in ACCOUNTANTS:
        clear_cache()
        start = time.perf_counter()
        result = compute_epsilon(SampledGaussian(z, q, steps), delta, name)
        times[f"epsilon_{name}_s"] = time.perf_counter() - start
        times[f"epsilon_{name}"] = result.epsilon
        times[f"epsilon_{name}_how"] = ACCOUNTANTS[name].summary(result.details)
    for name in calibrating():
        clear_cache()
        start = time.perf_counter()
        times[f"calibrate_{name}_z"] = calibrate_noise(7.2, sampled_gaussian(q, steps), delta, name)
        times[f"calibrate_{name}_s"] = time.perf_counter() - start
    return {
        "mechanism": {"noise_multiplier": z, "sampling_rate": q, "steps": steps, "delta": delta},
        "calibration_target_epsilon": 7.2,
        "targets_s": {"epsilon": 1.0, "calibrate": 10.0},
        **times,
    }
