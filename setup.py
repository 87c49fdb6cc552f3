"""Ships the top-level tasks/ and baselines/ folders inside the wheel as package data, so the
spec registry finds them after a non-editable install (pyproject.toml holds everything else)."""

from setuptools import find_packages, setup

SPEC_PACKAGES = {
    "pflbench.specs.tasks": "tasks",
    "pflbench.specs.tasks.templates": "tasks/templates",
    "pflbench.specs.baselines": "baselines",
}

setup(
    packages=find_packages("benchmark") + list(SPEC_PACKAGES),
    package_dir={"": "benchmark", **SPEC_PACKAGES},
    package_data={name: ["*.yaml"] for name in SPEC_PACKAGES},
)
