# Two entry points: `make demo` (the embedded default run) and `make test` (the test suite).
# Both create .venv on first use. torch is installed first and pinned so that this machine's local
# CPU build is used (an unpinned torch pulls gigabytes of CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $@

demo: install
	$(BIN)/pflbench run --task synth-cv-en-ls-seed --baseline perlayer-dim

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check benchmark tests
	$(BIN)/ruff format --check benchmark tests

clean:
	rm -rf $(VENV) build dist *.egg-info
