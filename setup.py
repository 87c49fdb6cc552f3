"""Ships the top-level tasks/ (with its shipped seed models) and baselines/ folders inside the
wheel as package data, so the spec registry finds them after a non-editable install, and builds
the privacy path's one-pass CPU kernels where a C compiler is found (optional: without them
pflbench runs the torch code they stand in for, to the same numbers; privacy/_kernels.c).
pyproject.toml holds everything else."""

from setuptools import Extension, find_packages, setup

SPEC_PACKAGES = {
    "pflbench.specs.tasks": "tasks",
    "pflbench.specs.tasks.templates": "tasks/templates",
    "pflbench.specs.tasks.seed-models": "tasks/seed-models",
    "pflbench.specs.baselines": "baselines",
}
PATTERNS = {"pflbench.specs.tasks.seed-models": ["*.safetensors", "*.json"]}

setup(
    packages=find_packages("benchmark") + list(SPEC_PACKAGES),
    package_dir={"": "benchmark", **SPEC_PACKAGES},
    package_data={name: PATTERNS.get(name, ["*.yaml"]) for name in SPEC_PACKAGES},
    ext_modules=[
        Extension(
            "pflbench.privacy._kernels",
            ["benchmark/pflbench/privacy/_kernels.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ],
)
