"""`pflbench bench privacy`: how long the accountants take (printed, never asserted)."""

from __future__ import annotations

import time

from pflbench.privacy.accountants import calibrate_noise, clear_cache, compute_epsilon


def bench_privacy() -> dict:
    """Wall-clock seconds of one epsilon at T=2000 per accountant and one calibration each."""
    z, q, steps, delta = 1.0, 0.01, 2000, 1e-9
    start = time.perf_counter()
    import dp_accounting.pld  # noqa: F401  (the accountants import lazily: time it apart)
    import opacus.accountants.analysis.rdp  # noqa: F401

    times: dict = {"import_libraries_s": time.perf_counter() - start}
    details: dict = {}
    for name in ("rdp", "pld"):
        clear_cache()
        start = time.perf_counter()
        result = compute_epsilon(z, q, steps, delta, name)
        times[f"epsilon_{name}_s"] = time.perf_counter() - start
        times[f"epsilon_{name}"] = result.epsilon
        details[name] = result.details
    for name in ("rdp", "pld"):
        clear_cache()
        start = time.perf_counter()
        times[f"calibrate_{name}_z"] = calibrate_noise(7.2, q, steps, delta, name)
        times[f"calibrate_{name}_s"] = time.perf_counter() - start
    return {
        "mechanism": {"noise_multiplier": z, "sampling_rate": q, "steps": steps, "delta": delta},
        "calibration_target_epsilon": 7.2,
        "targets_s": {"epsilon": 1.0, "calibrate": 10.0},
        "pld_discretization": details["pld"]["value_discretization_interval"],
        "pld_discretization_rule": details["pld"]["discretization_rule"],
        **times,
    }
