"""Two branches of one conversation admitted in the same engine step, run in a fresh
process: ``python -m tests.vllm.same_step_branches MODEL`` prints JSON with the
branches' prompts, greedy outputs and cached tokens.

The engine runs in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so both
branches are queued before its next step. It needs a process of its own: vLLM's
in-process worker rebinds Triton kernels by scanning every loaded module, which
fails once numba's llvmlite is loaded, as it is in a test process that already
started a kvbackend engine.
"""

from __future__ import annotations

import os
import random
import sys

from tests.vllm.conftest import BLOCK_SIZE, make_engine, print_results, shutdown


def branches(seed: int = 7) -> tuple[list[int], list[list[int]]]:
    """A conversation ending 8 tokens into its second block, and two branches that
    share 8 more tokens (still inside that block) before they differ."""
    rng = random.Random(seed)
    words = lambda n, first: [first] + [rng.randrange(3, 512) for _ in range(n - 1)]  # noqa
    conversation = words(BLOCK_SIZE + 8, rng.randrange(3, 512))
    common = words(8, 11)
    return conversation, [conversation + common + words(20, 20 + i) for i in range(2)]


def main(model: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = make_engine(model, "kvbackend")
    try:
        conversation, prompts = branches()
        llm.generate([{"prompt_token_ids": conversation}], params, use_tqdm=False)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        print_results(got, conversation=conversation, prompts=prompts)
    finally:
        shutdown(llm)


if __name__ == "__main__":
    main(sys.argv[1])
