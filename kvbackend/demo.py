"""kvbackend vs vLLM's own prefix caching on one offline batch (``make demo``).

Builds a tiny random Llama under ``.cache/demo-model`` (nothing is downloaded), then
runs the same batch through two vLLM engines, one after the other: kvbackend
(token-exact prefix matching) and vLLM's automatic prefix caching (whole hashed
blocks). Every request shares a 1000-token system prompt, which does not end on a
32-token block boundary, followed by its own question.

Usage: ``python -m kvbackend.demo [--model-dir DIR] [--requests 8]``
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

BLOCK_SIZE = 32  # the smallest block vLLM's CPU attention accepts; it makes the gap visible
SYSTEM_LEN = 1000  # 31 full blocks + 8 tokens
MAX_TOKENS = 8


def make_prompts(num_requests: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = range(3, 512)  # the tiny model's word ids; 0-2 are <unk> <s> </s>
    system = [rng.choice(words) for _ in range(SYSTEM_LEN)]
    return [system + [rng.choice(words) for _ in range(rng.randint(16, 48))]
            for _ in range(num_requests)]


def run_engine(model: str, name: str, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams

    import kvbackend.vllm

    if name == "kvbackend":
        mode = kvbackend.vllm.engine_kwargs()
    else:
        mode = {"enable_prefix_caching": True}
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True,
              block_size=BLOCK_SIZE, kv_cache_memory_bytes=32 << 20, seed=0, **mode)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    try:
        # Warm-up of the hit paths (first-call JIT, block copies), untimed, on ids that no
        # demo prompt contains: the second prompt shares 2 full blocks + 6 tokens.
        for warm in ([1] * 70 + [2] * 4, [1] * 70 + [2, 1]):
            llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
        t0 = time.perf_counter()
        # The first request warms the cache with the system prompt; the rest come as a batch.
        outputs = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params,
                                use_tqdm=False)
        wall_s = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"start_s": start_s, "wall_s": wall_s,
            "cached": [o.num_cached_tokens or 0 for o in outputs],
            "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=os.path.join(".cache", "demo-model"))
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args(argv)

    from kvbackend.testing.tiny_model import build_tiny_llama

    model = build_tiny_llama(args.model_dir)
    prompts = make_prompts(args.requests)
    results = {name: run_engine(model, name, prompts) for name in ("kvbackend", "vllm-apc")}
    kvb, apc = results["kvbackend"], results["vllm-apc"]

    full = SYSTEM_LEN // BLOCK_SIZE * BLOCK_SIZE
    print()
    print(f"{len(prompts)} requests: a {SYSTEM_LEN}-token shared system prompt + a 16-48 token "
          f"question each, greedy, {MAX_TOKENS} output tokens.")
    print(f"Block size {BLOCK_SIZE}: vLLM reuses whole blocks only ({full} of the {SYSTEM_LEN} "
          f"shared tokens); kvbackend reuses all {SYSTEM_LEN}.")
    print("Request 0 runs first and warms the cache; requests 1.. follow as one batch.\n")
    print(f"{'req':>3}  {'prompt':>6}  {'cached kvbackend':>16}  {'cached vLLM':>11}  "
          f"{'same output':>11}")
    for i, prompt in enumerate(prompts):
        same = "yes" if kvb["tokens"][i] == apc["tokens"][i] else "NO"
        print(f"{i:>3}  {len(prompt):>6}  {kvb['cached'][i]:>16}  {apc['cached'][i]:>11}  "
              f"{same:>11}")
    print(f"\n{'total cached':>11}  {sum(kvb['cached']):>16}  {sum(apc['cached']):>11}")
    for name, r in results.items():
        print(f"{name:>9}: engine start {r['start_s']:5.1f} s, batch wall time {r['wall_s']:.2f} s")
    if kvb["tokens"] != apc["tokens"]:
        raise SystemExit("outputs differ between kvbackend and vLLM prefix caching")


if __name__ == "__main__":
    main()
