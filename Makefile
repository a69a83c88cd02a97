# Two commands: `make up` serves the default model on http://127.0.0.1:8000,
# `make test` runs the whole suite. Both create .venv and install when needed.
# `make test-fast` runs the tests that stay in one process (seconds), to run while editing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: up test test-fast lint typecheck bench clean system-deps constraints

# The installs go through uv (a pinned wheel from PyPI, into the venv): the same packages as
# pip, from the same constraints, in about 17 s where pip took 100 s in a fresh clone. pip's
# find-links (a machine's own wheels: torch's CPU build here, PIP_FIND_LINKS) are uv's too.
UV_VERSION := 0.13.9
UV_BIN := $(VENV)/bin/uv
UV := $(UV_BIN) pip install -q --python $(PY) -c constraints.txt $(foreach f,$(PIP_FIND_LINKS),--find-links $(f))

$(PY):
	$(PYTHON) -m venv $(VENV)

# Its own target: a venv made before the installs went through uv gets it too.
$(UV_BIN): | $(PY)
	$(PY) -m pip install -q uv==$(UV_VERSION)

# Reinstall only when the dependencies change (a second `make up` starts in seconds). Every
# version comes from constraints.txt: two installs made months apart get the same packages.
# The worked example of a model package (docs/models.md) is installed too, so that its entry
# point (`--model reverse`) is there for the suite. It is built with the venv's setuptools,
# constraints.txt's version (a venv of Python 3.12 or later has none of its own), not in an
# isolated build environment that would fetch one.
$(STAMP): pyproject.toml constraints.txt examples/reverse_model/pyproject.toml | $(UV_BIN)
	$(UV) torch==2.13.0 -e '.[models,dev,eval]' setuptools
	$(UV) --no-deps --no-build-isolation -e examples/reverse_model
	touch $(STAMP)

# constraints.txt again from what .venv holds now (after an upgrade there passed the tests).
constraints:
	$(PY) scripts/constraints.py

up: $(STAMP)
	$(VENV)/bin/duplexbus up $(ARGS)

system-deps:
	@bash scripts/system-deps.sh

# -rs: a skipped test says why in one line (a compose test with no engine to run on, a
# browser test with no chromium), never silently. scripts/test.sh runs the modules that are not
# heavy (two xdist workers) beside the container tests, then the heavy ones (tests/conftest.py) in
# two lanes side by side with ruff and mypy after the timed one, then the browser alone. A run
# that ARGS leaves no test after the split is no failure.
test: $(STAMP) system-deps
	PY=$(PY) bash scripts/test.sh $(ARGS)

# No nats-server, no process (the tests tests/support/tiers.py leaves unmarked), nothing marked
# slow; the five slowest are listed, so a slow newcomer is seen.
test-fast: $(STAMP)
	$(PY) -m pytest -q -rs -m "not integration and not slow" --durations=5 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf .run
