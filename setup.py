"""Ships the top-level tasks/ (with its shipped seed models) and baselines/ folders inside the
wheel as package data, so the spec registry finds them after a non-editable install, and builds
the privacy path's one-pass CPU kernels where a C compiler is found (optional: without them
pflbench runs the torch code they stand in for, to the same numbers; privacy/_kernels.c).
pyproject.toml holds everything else."""

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

SPEC_PACKAGES = {
    "pflbench.specs.tasks": "tasks",
    "pflbench.specs.tasks.templates": "tasks/templates",
    "pflbench.specs.tasks.seed-models": "tasks/seed-models",
    "pflbench.specs.baselines": "baselines",
}
PATTERNS = {"pflbench.specs.tasks.seed-models": ["*.safetensors", "*.json"]}
# Flags that would fold the kernels' rounding away and link a startup file that flushes
# subnormals to zero in the whole process (torch's numbers too); CFLAGS may carry them.
FAST_MATH = {"-Ofast", "-ffast-math", "-funsafe-math-optimizations"}


class BuildKernels(build_ext):
    """Builds the kernels with IEEE arithmetic whatever CFLAGS say (_kernels.c)."""

    def build_extensions(self):
        for command in ("compiler_so", "linker_so"):
            args = getattr(self.compiler, command, None)
            if args:
                setattr(self.compiler, command, [a for a in args if a not in FAST_MATH])
        super().build_extensions()


setup(
    packages=find_packages("benchmark") + list(SPEC_PACKAGES),
    package_dir={"": "benchmark", **SPEC_PACKAGES},
    package_data={name: PATTERNS.get(name, ["*.yaml"]) for name in SPEC_PACKAGES},
    ext_modules=[
        Extension(
            "pflbench.privacy._kernels",
            ["benchmark/pflbench/privacy/_kernels.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildKernels},
)
