# memtrain: `make demo` trains the demo job on this machine, `make test` runs the test suite.
# Every target but `gpu-check` uses the project's virtual environment in .venv (made by `setup`).

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA := data/stdlib
RUN ?= demo-$(shell date +%Y%m%d-%H%M%S)
PYTEST_ARGS ?=
# Test processes: the session Ray cluster's tests share one (xdist_group "ray"), the multi-node
# scenario (its own cluster) keeps to one (xdist_group "multinode"), the rest spread over both.
PYTEST_WORKERS ?= 2
# gpu-check runs on the machine's own torch, from the source tree
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= bench/results
GPU_CHECK_ARGS ?=
# k8s/overlays/: cluster (long-lived RayCluster) or job (one RayJob)
OVERLAY ?= cluster
CONFIG ?= configs/gpt2-124m-8xgpu.yaml
SUBMIT_ARGS ?=
# cluster-data: where the text is on the shared volume, and the tokenizer (trained if absent)
TEXT ?=
VOCAB_SIZE ?=
TOKENIZER ?=

.DEFAULT_GOAL := help
.PHONY: help setup lock image image-check data demo test test-unit lint dashboards bench-memory bench-metrics gpu-check clean bench bench-data bench-qlora bench-qlora-largest bench-long \
	bench-tokenize bench-hf bench-plan bench-plan-trace bench-fsdp bench-strategies bench-checkpoints bench-uploads bench-elastic chaos tracker-screenshots up down status submit cluster-data grafana local local-down

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# `make submit` needs only memtrain's core install (the Jobs client, no torch), on any Python
# 3.10-3.12: its own small environment.
SUBMIT_PYTHON ?= python3
SUBMIT_VENV := .venv-submit
# The image: docker or podman; VARIANT gpu (the default) or cpu; tag <version>-<git revision>.
ENGINE ?= $(shell command -v docker >/dev/null 2>&1 && echo docker || echo podman)
VARIANT ?= gpu
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REVISION := $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
IMAGE_NAME ?= memtrain
IMAGE_TAG := $(VERSION)-$(REVISION)$(if $(filter cpu,$(VARIANT)),-cpu)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (memtrain needs Python 3.11; set PYTHON=...)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e '.[train,dev,hf,tracking,strategies]'
	@# pip byte-compiles one file at a time (over a minute on 2 cores); compileall uses every
	@# core. A file that does not compile is only imported slower, as pip would leave it.
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $(STAMP)

setup: $(STAMP) ## Create .venv and install memtrain with its pinned dependencies

$(SUBMIT_VENV)/.installed: pyproject.toml
	$(SUBMIT_PYTHON) -m venv $(SUBMIT_VENV)
	$(SUBMIT_VENV)/bin/pip install --quiet --upgrade pip
	$(SUBMIT_VENV)/bin/pip install --quiet .
	touch $@

lock: setup ## Rewrite the image's hashed lock files (docker/requirements/) from pyproject.toml
	$(BIN)/python scripts/lock.py

image: ## Build the image (VARIANT=gpu|cpu) as $(IMAGE_NAME):<version>-<git revision>
	$(ENGINE) build -f docker/Dockerfile --build-arg VARIANT=$(VARIANT) \
		--build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) \
		$(if $(filter cpu,$(VARIANT)),--build-arg BASE=docker.io/library/debian:bookworm-slim) \
		-t $(IMAGE_NAME):$(IMAGE_TAG) .
	@echo "image: $(IMAGE_NAME):$(IMAGE_TAG); push it, then: IMAGE=REGISTRY/$(IMAGE_NAME):$(IMAGE_TAG) make up"

image-check: setup data ## podman: build the CPU image here, train, healthcheck and submit inside it
	$(BIN)/python scripts/image_check.py --out bench/results

$(DATA)/train/manifest.json: | $(STAMP)
	$(BIN)/memtrain data corpus $(DATA)

data: $(DATA)/train/manifest.json ## Build the demo dataset from the Python standard library

demo: setup data ## Train the demo GPT: 2 Ray Train workers, activation ckpt + accumulation, AMP where the CPU has bf16
	$(BIN)/memtrain train --config configs/demo-cpu.yaml --run-name $(RUN)

test: setup ## Run every test: unit, distributed (gloo, Ray), e2e (a real Prometheus)
	bash scripts/install-prometheus.sh
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-unit: setup ## The inner loop: the unit tests that take under seconds each (not `slow`), in minutes
	$(BIN)/pytest -n $(PYTEST_WORKERS) -m "unit and not slow" $(PYTEST_ARGS)

dashboards: setup ## Regenerate monitoring/grafana/dashboards/*.json from monitoring/dashboards.py
	$(BIN)/memtrain dashboards

lint: setup ## ruff and mypy
	$(BIN)/ruff check trainer datapipe monitoring tests scripts bench
	$(BIN)/mypy

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install --quiet -e '.[train,dev,bench]'
	touch $@

bench: $(VENV)/.bench-installed ## Every CPU benchmark: bench/results/<date>-<host>.{json,md} (~10 min)
	$(BIN)/python -m bench.run_all --out bench/results

bench-data: $(VENV)/.bench-installed ## Loader samples/s and GB/s: raw Arrow limit, memtrain, HF datasets, Ray Data
	$(BIN)/python -m bench.loader --out bench/results

bench-tokenize: setup ## memtrain data write --tokenizer vs tokenizers' own batch encoding (MB/s)
	$(BIN)/python -m bench.tokenize --out bench/results

bench-memory: setup ## CPU: activation bytes and step time per precision x checkpointing, planner beside
	$(BIN)/python -m bench.memory --out bench/results

SEED ?= 0
chaos: setup ## A seeded chaos campaign on a 2-node loopback Ray cluster (SEED=n replays one)
	$(BIN)/python -m tests.chaos.campaign --seed $(SEED) --out bench/results

bench-elastic: setup ## Ray: an elastic group's start size and growth after a killed driver, 10 tries
	$(BIN)/python -m bench.elastic_start --out bench/results

bench-plan: setup ## CPU: the planner's predicted tokens/s against measured steps, 3 model shapes
	$(BIN)/python -m bench.plan --out bench/results

bench-plan-trace: setup ## CPU: one block's bytes as the planner plans them and as MemTracker traces them, against the allocator
	$(BIN)/python -m bench.plan_trace --out bench/results

bench-fsdp: setup ## FSDP on gloo ranks: the largest GPT under a per-rank budget (host vs meta build); memtrain's own workers' resident memory
	$(BIN)/python -m bench.fsdp --out bench/results
	$(BIN)/python -m bench.fsdp_resident --out bench/results

bench-hf: setup ## A HF Llama at vocabulary 128,256: chunked loss vs its own labels= loss (peak, tokens/s)
	$(BIN)/python -m bench.hf --out bench/results

bench-checkpoints: setup ## What checkpoints cost: checking one against its manifest (the demo's, 1 GiB), and a save every step, sync vs async, to the step of 1 and 2 local workers (about 5 min)
	$(BIN)/python -m bench.checkpoints --out bench/results

bench-uploads: setup ## An 8-rank checkpoint uploaded to a local S3 server through a slow proxy: one file at a time vs in parallel
	$(BIN)/python -m bench.uploads --out bench/results

bench-strategies: setup ## A HF Llama on CPU, torchtune's cumulative table: checkpointing, step in backward, offload, 8-bit AdamW, LoRA, QLoRA
	$(BIN)/python -m bench.strategies --out bench/results

bench-qlora: setup ## QLoRA's eval loss against LoRA on a bf16 base over the same 200 steps (about 2 min)
	$(BIN)/python -m bench.qlora_quality --out bench/results

bench-qlora-largest: setup ## The largest Llama whose LoRA fine-tune fits 192 MiB a rank: NF4 base against bf16, 1 and 4 ranks
	$(BIN)/python -m bench.qlora_largest --out bench/results

bench-long: setup ## The longest sequence whose step fits 96 MiB a rank on 4 gloo ranks: one row a rank vs sequence parallel 4 + tiled MLP
	$(BIN)/python -m bench.long_sequence --out bench/results

bench-metrics: setup ## Cost of recording the metrics contract as a share of step time (<= 1%)
	$(BIN)/python -m bench.metrics_overhead --out bench/results

tracker-screenshots: setup ## docs/images/{mlflow,tensorboard}.png: two runs in each UI (needs chromium)
	$(BIN)/python scripts/tracker_screenshots.py --out docs/images

gpu-check: ## CUDA: peak memory, tokens/s, MFU, planner error, OOM recovery (no CUDA: dry mode)
	@py="$(GPU_PYTHON)"; \
	if ! $$py -c "import torch" 2>/dev/null; then \
		if [ -x $(BIN)/python ]; then py=$(BIN)/python; echo "gpu-check: $(GPU_PYTHON) has no torch, using $$py"; \
		else echo "error: gpu-check needs torch, pyarrow, numpy and prometheus-client; $(GPU_PYTHON) has no torch and there is no $(VENV) (make setup, or GPU_PYTHON=...)"; exit 2; fi; \
	fi; \
	PYTHONPATH=. $$py -m bench.gpu_check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

up: ## Kubernetes: check prerequisites, then apply k8s/overlays/$(OVERLAY) (+ monitoring)
	bash scripts/k8s.sh up $(OVERLAY)

down: ## Kubernetes: delete the Ray cluster or job (the data volume and token are kept)
	bash scripts/k8s.sh down $(OVERLAY)

status: ## Kubernetes: Ray clusters, jobs, pods and volumes of the memtrain namespace
	bash scripts/k8s.sh status

submit: $(SUBMIT_VENV)/.installed ## Kubernetes: submit CONFIG through the Ray Jobs API (port-forward) and follow it
	MEMTRAIN=$(SUBMIT_VENV)/bin/memtrain bash scripts/k8s.sh submit $(CONFIG) $(SUBMIT_ARGS)

cluster-data: ## Kubernetes: text on the volume (TEXT=/mnt/memtrain/text) -> tokenizer -> shards for CONFIG
	TEXT=$(TEXT) VOCAB_SIZE=$(VOCAB_SIZE) TOKENIZER=$(TOKENIZER) bash scripts/k8s.sh data

grafana: ## Kubernetes: port-forward Grafana to http://127.0.0.1:3000
	bash scripts/k8s.sh grafana

local: setup data ## Docker + GPUs: Ray head, Prometheus, Grafana on 127.0.0.1; submit the demo
	MEMTRAIN=$(BIN)/memtrain bash scripts/local.sh up

local-down: ## Docker: stop the local run (volumes kept)
	bash scripts/local.sh down

clean: ## Remove runs, data and the virtual environment
	rm -rf runs data $(VENV) $(SUBMIT_VENV)
