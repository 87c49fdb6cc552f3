# Two entry points: `make demo` (the embedded default run) and `make test` (the test suite).
# Both create .venv on first use, installing the versions constraints.txt pins (the lock: two fresh
# machines get the same stack, hence the same numbers). Its torch pin keeps pip from choosing a
# version only a CUDA wheel satisfies; where a local CPU build of it is on pip's find-links, it is
# the one used. The editable install also builds the privacy path's C kernels in place (setup.py),
# again when its source changes. `make lock` rewrites constraints.txt from the installed .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: install demo test lint lock clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py constraints.txt benchmark/pflbench/privacy/_kernels.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -c constraints.txt -e ".[dev]"
	touch $@

demo: install
	$(BIN)/pflbench run --task synth-cv-en-ls-seed --baseline perlayer-dim

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check benchmark tests scripts
	$(BIN)/ruff format --check benchmark tests scripts

# Pins what .venv holds now (after an intended upgrade there), pflbench itself left out; a local
# build's label (2.13.0+cpu) is dropped so that other builds of the same version satisfy the pin.
lock: install
	{ sed -n '1,3p' constraints.txt; $(PIP) freeze --exclude-editable | grep -v '^#' \
	  | grep -iv '^pflbench' | sed 's/+[a-z0-9.]*$$//'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) build dist *.egg-info benchmark/pflbench/privacy/_kernels*.so
