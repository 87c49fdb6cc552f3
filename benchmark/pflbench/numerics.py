"""What decides a run's numbers besides its code, config and data: the versions of the packages
that compute them and the CPU kernels torch runs (records and seed-model sidecars state both).

On CPU, float results depend on which code path each library picks for the machine: torch's
vectorized ATen kernels (by CPU capability, env ATEN_CPU_CAPABILITY), MKL's GEMM branch (by ISA
and vendor, env MKL_CBWR) and oneDNN's JIT kernels for convolutions and GELU (by ISA, env
ONEDNN_MAX_CPU_ISA; off with torch.backends.mkldnn.enabled = False). Every one of these changes
the trained weights on an AVX-512 CPU, so two CPUs that pick different paths train different
models from the same data (docs/RESULTS.md, "The same numbers on any machine").
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

# Bumped whenever a change to pflbench's own code changes the numbers a run produces from the same
# config, data and packages. Records state it; the leaderboard marks rows run with an older one
# stale, with the reason below, and submit files them only with --stale. A bump turns every filed
# run stale: `pflbench results pin-stale` pins them (sweeps/stale-records.txt) before CI passes.
NUMERICS_VERSION = 4
NUMERICS_CHANGES = {
    2: "clipping exact in fp32/bf16/fp16 (fp64 norms, a proven margin), LAMB/LARS trust ratios"
    " from fp64 norms, LARS's ξ = 1e-6, and one keyed-seed function for every random stream",
    3: "transcripts with whitespace normalized as references are (CER counted a space the best"
    " path emitted at either end or twice in a row)",
    4: "DP noise added to the exact sum before anything is rounded (user-level: it went onto the"
    " average once rounded to fp32, or, placed at the clients, onto each update in fp32;"
    " example-level: onto the fp32 sum of the clipped examples; so one user or example could"
    " move the release by more than its bound), and Poisson inclusion"
    " at most q (draws compared with q rounded down onto their 2^-24 grid; a run without DP"
    " changes only where a draw fell on that point, none of the filed ones)",
}
# The runs a change's numbers differ in, where not every run: "dp", runs with DP noise (user- or
# example-level). A run of an older version that no later change touches has today's numbers.
NUMERICS_SCOPES = {4: "dp"}


def current_numerics(version: int, dp: bool) -> int:
    """The numerics version whose numbers a run of `version` has: the latest one reached
    without a change since that touches runs like it (NUMERICS_SCOPES)."""
    while version < NUMERICS_VERSION:
        scope = NUMERICS_SCOPES.get(version + 1)
        if scope is None or (scope == "dp" and dp):
            break
        version += 1
    return version


# Distributions whose versions can change a number: audio decoding and resampling, speech and
# text synthesis, WER, the accountants (torch's is the record's torch_version).
NUMERIC_PACKAGES = (
    "numpy",
    "scipy",
    "soundfile",
    "soxr",
    "espeakng-loader",
    "lameenc",
    "wordfreq",
    "unidecode",
    "jiwer",
    "opacus",
    "dp-accounting",
    "prv-accountant",
)
# CPU flags that decide the kernels above (a VM's model name is often generic).
KERNEL_ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_tile",
)


def package_versions() -> dict[str, str | None]:
    """Version of each of NUMERIC_PACKAGES (None: not installed) and of the native libraries two
    of them wrap (libsndfile, libsoxr, libespeak-ng)."""
    versions: dict[str, str | None] = {}
    for name in NUMERIC_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import soundfile
    import soxr

    from pflbench.data.espeak import espeak_version

    versions["libsndfile"] = soundfile.__libsndfile_version__
    versions["libsoxr"] = getattr(soxr, "__libsoxr_version__", None)
    versions["libespeak-ng"] = espeak_version()
    return versions


def cpu_kernels() -> dict:
    """This machine's CPU (model, vendor, the flags in KERNEL_ISA_FLAGS it has) and the kernels
    torch runs on it: ATen's capability, MKL's and oneDNN's settings, float32 matmul precision."""
    import torch

    info = _proc_cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "model": info.get("model name") or platform.processor() or platform.machine(),
        "vendor": info.get("vendor_id"),
        "isa": [flag for flag in KERNEL_ISA_FLAGS if flag in flags],
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "onednn_enabled": torch.backends.mkldnn.enabled,
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _proc_cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields
