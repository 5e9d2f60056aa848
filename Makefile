# commhook-conformance
#   make conform   run the conformance suite (PyTorch's built-in hooks, plus HOOKS); reports/
#                  gets conformance.xml (JUnit), conformance.json (docs/results.md), conformance.md
#   make test      run the project's own tests (what CI runs)
#   make test-fast the unit tests alone (pytest -m unit: no rank, no run of the suite), in about a
#                  minute on 2 cores; tests/kinds.py gives each test module its kind
#   make bench     per-case time of the rank pool vs spawn-per-case on a sample of the default
#                  run's cases (ARGS go to benchmarks/pool_overhead.py), then the default run's wall time
#   make compat TORCH=2.11.0   one row of docs/compatibility.md's torch table (a one-off:
#                  installs that torch, several GB, into .compat/; never run in CI)
#
# PYTHON picks the interpreter (default: python3). Setup (scripts/setup_env.py)
# installs only what is missing: torch==2.13.0 where no torch is importable (an
# existing torch is never replaced), then this package and its small dependencies;
# make test and make test-fast add the test extra (import-linter) with setup_env.py --test.

PYTHON ?= python3
HOOKS ?=
ARGS ?=
REPORTS ?= reports

INTERPRETER_ID := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.executable.encode()).hexdigest()[:10])' 2>/dev/null || echo none)
STAMP := .setup-$(INTERPRETER_ID).stamp
# make test also needs the package's test extra (import-linter); make conform does not, so an offline GPU node
# runs the suite without the linter's wheels.
TEST_STAMP := .setup-test-$(INTERPRETER_ID).stamp
HOOK_ARGS := $(foreach h,$(HOOKS),--hook $(h)) $(if $(strip $(HOOKS)),--with-builtins)

TORCH ?=
COMPAT_PYTHON ?= $(PYTHON)
COMPAT_VENV ?=

.PHONY: setup conform test test-fast bench compat clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.py
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: PYTHON=$(PYTHON) not found; run make PYTHON=/path/to/python ..." >&2; exit 2; }
	@$(PYTHON) scripts/setup_env.py
	@touch $@

$(TEST_STAMP): $(STAMP)
	@$(PYTHON) scripts/setup_env.py --test
	@touch $@

conform: setup
	@mkdir -p $(REPORTS)
	$(PYTHON) -m conformance -v --junitxml=$(REPORTS)/conformance.xml --json=$(REPORTS)/conformance.json \
		--markdown=$(REPORTS)/conformance.md $(HOOK_ARGS) $(ARGS)

test: $(TEST_STAMP)
	@$(PYTHON) -c 'import sys, expecttest, pytest_timeout, jsonschema; sys.version_info < (3, 10) or __import__("importlinter")' || { echo "make test needs expecttest, pytest-timeout, jsonschema and import-linter (scripts/setup_env.py --test installs them)" >&2; exit 2; }
	$(PYTHON) -m pytest tests $(ARGS)

test-fast: $(TEST_STAMP)
	@$(PYTHON) -c 'import sys, expecttest, pytest_timeout, jsonschema; sys.version_info < (3, 10) or __import__("importlinter")' || { echo "make test-fast needs expecttest, pytest-timeout, jsonschema and import-linter (scripts/setup_env.py --test installs them)" >&2; exit 2; }
	$(PYTHON) -m pytest tests -m unit $(ARGS)

bench: setup
	$(PYTHON) benchmarks/pool_overhead.py $(ARGS)
	$(PYTHON) benchmarks/default_run.py

compat:
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.11.0 [COMPAT_PYTHON=python3.9] [COMPAT_VENV=dir]" >&2; exit 2; }
	$(COMPAT_PYTHON) scripts/compat_row.py --torch $(TORCH) $(if $(COMPAT_VENV),--venv $(COMPAT_VENV))

clean:
	rm -rf $(REPORTS) .setup-*.stamp .pytest_cache .hypothesis build *.egg-info
