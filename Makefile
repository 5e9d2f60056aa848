# commhook-conformance
#   make conform   run the conformance suite (PyTorch's built-in hooks, plus HOOKS)
#   make test      run the project's own tests (what CI runs)
#   make bench     print the rank pool's speed figures
#
# PYTHON picks the interpreter (default: python3). Setup installs only what is
# missing: torch==2.13.0 where no torch is importable (an existing torch is never
# replaced), then this package and its small dependencies.

PYTHON ?= python3
HOOKS ?=
ARGS ?=
REPORTS ?= reports

STAMP := .setup-$(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.executable.encode()).hexdigest()[:10])' 2>/dev/null || echo none).stamp
HOOK_ARGS := $(foreach h,$(HOOKS),--hook $(h)) $(if $(strip $(HOOKS)),--with-builtins)

.PHONY: setup conform test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: PYTHON=$(PYTHON) not found; run make PYTHON=/path/to/python ..." >&2; exit 2; }
	@if $(PYTHON) -c 'import torch' >/dev/null 2>&1; then \
		echo "setup: using the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') (never replaced)"; \
	else \
		echo "setup: no torch found for $(PYTHON); installing torch==2.13.0"; \
		$(PYTHON) -m pip install torch==2.13.0; \
	fi
	@# setuptools builds the editable install without network access (GPU nodes are often offline).
	@$(PYTHON) -c 'import setuptools' >/dev/null 2>&1 || $(PYTHON) -m pip install "setuptools>=64"
	@$(PYTHON) -m pip install --no-build-isolation -e . || { \
		echo "setup: could not install every dependency (offline?); installing the package alone" >&2; \
		$(PYTHON) -m pip install --no-build-isolation --no-deps -e .; }
	@$(PYTHON) -c 'import torch, pytest, hypothesis, packaging; print("setup: torch", torch.__version__, "ready")'
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
