"""kvbackend's tier connector in the caller's process: vLLM imports the connector
module while it builds its config, before its CPU worker rebinds Triton kernels by
walking ``sys.modules``, which fails on llvmlite (numba's) objects."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm import SamplingParams

from tests.vllm.conftest import BLOCK_SIZE, numba_modules_after


def test_importing_the_tier_connector_does_not_load_numba():
    assert numba_modules_after("import kvbackend.vllm.tiers.connector") == "[]"


def test_an_in_process_engine_with_a_host_tier_starts_and_hits(tiny_model, reference_llm):
    """``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine starts; after a device reset the
    prompt's whole blocks come back from the host tier, and its branch then hits the
    device cache token-exactly; greedy outputs are vLLM's without caching."""
    done = subprocess.run([sys.executable, "-m", "tests.vllm.tiers_in_process", tiny_model],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith('{"prompts"')]
    result = json.loads(line)
    want = reference_llm.generate([{"prompt_token_ids": p} for p in result["prompts"]],
                                  SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert result["outputs"] == [list(w.outputs[0].token_ids) for w in want]
    first, branch = result["prompts"]
    shared = next(i for i, (a, b) in enumerate(zip(first, branch)) if a != b)
    assert result["cached"] == [(len(first) - 1) // BLOCK_SIZE * BLOCK_SIZE, shared]
