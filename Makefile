# commhook-conformance
#   make conform   run the conformance suite (PyTorch's built-in hooks, plus HOOKS)
#   make test      run the project's own tests (what CI runs)
#   make bench     print the rank pool's speed figures
#
# PYTHON picks the interpreter (default: python3). Setup (scripts/setup_env.py)
# installs only what is missing: torch==2.13.0 where no torch is importable (an
# existing torch is never replaced), then this package and its small dependencies.

PYTHON ?= python3
HOOKS ?=
ARGS ?=
REPORTS ?= reports

STAMP := .setup-$(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.executable.encode()).hexdigest()[:10])' 2>/dev/null || echo none).stamp
HOOK_ARGS := $(foreach h,$(HOOKS),--hook $(h)) $(if $(strip $(HOOKS)),--with-builtins)

.PHONY: setup conform test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.py
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: PYTHON=$(PYTHON) not found; run make PYTHON=/path/to/python ..." >&2; exit 2; }
	@$(PYTHON) scripts/setup_env.py
	@touch $@

conform: setup
	@mkdir -p $(REPORTS)
	$(PYTHON) -m conformance -v --junitxml=$(REPORTS)/conformance.xml $(HOOK_ARGS) $(ARGS)

test: setup
	@$(PYTHON) -c 'import expecttest, pytest_timeout' || { echo "make test needs expecttest and pytest-timeout" >&2; exit 2; }
	$(PYTHON) -m pytest tests $(ARGS)

bench: setup
	$(PYTHON) benchmarks/pool_overhead.py $(ARGS)

clean:
	rm -rf $(REPORTS) .setup-*.stamp .pytest_cache .hypothesis build *.egg-info
