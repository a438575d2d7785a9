"""An engine with a host tier in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
run in a fresh interpreter: ``python -m tests.vllm.tiers_in_process MODEL`` prints JSON
with the prompts, their greedy outputs and cached tokens.

A prompt runs, the device cache is reset (the host tier keeps its blocks), then the
prompt again (its whole blocks from the host tier) and a branch sharing its first 120
tokens (from the device cache the prompt refilled).
A fresh interpreter, because vLLM's in-process worker fails to start in a process that
has loaded numba's llvmlite (see ``kvbackend.vllm.tiers.connector``).
"""

from __future__ import annotations

import os
import random
import sys

from tests.vllm.conftest import make_engine, print_results, shutdown


def prompts(seed: int = 11) -> list[list[int]]:
    """A 200-token prompt and a branch sharing its first 120 tokens."""
    rng = random.Random(seed)
    first = [rng.randrange(3, 512) for _ in range(200)]
    return [first, first[:120] + [rng.randrange(3, 512) for _ in range(60)]]


def main(model: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from kvbackend.vllm import engine_kwargs
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = make_engine(model, "kvbackend", **engine_kwargs(host_cache_gb=0.05))
    try:
        first, branch = prompts()
        llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        assert llm.reset_prefix_cache()  # the device tree only: the host tier keeps its blocks
        got = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
               for p in (first, branch)]
        print_results(got, prompts=[first, branch])
    finally:
        shutdown(llm)


if __name__ == "__main__":
    main(sys.argv[1])
