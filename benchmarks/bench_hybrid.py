"""A Mamba / linear-attention hybrid in vLLM (CPU): kvbackend beside vLLM's prefix caching.

    python benchmarks/bench_hybrid.py [--rounds 4] [--agents 8] [--budget 2048]

Model: the tiny random Qwen3-Next (``build_tiny_qwen3_next``: one Gated DeltaNet layer,
one full-attention layer, bfloat16; vLLM fits one state page in a 288-token block).
Workload: ``--agents`` conversations on one 1,500-token system prompt, each turn adding
the 16 greedy output tokens and a 30-token user message, ``--rounds`` turns, every turn
one ``LLM.generate`` batch. Engines, one after another in this process:

    no-cache    vLLM, enable_prefix_caching=False
    vllm-apc    vLLM's prefix caching (mamba_cache_mode "align")
    kvbackend   kvbackend.vllm.engine_kwargs() (the same "align" mode, kvbackend's tree)

Reported per engine: the batches' wall time, relative to vllm-apc (measured in one run;
absolute times on shared machines are noisy), the prompt tokens reused out of all prompt
tokens, and whether the greedy outputs equal vllm-apc's token for token (in bfloat16 the
state layer's outputs depend on where prefill chunks end, and no-cache ends them
elsewhere: its outputs may differ, which says nothing of caching).
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time

ENGINES = ("no-cache", "vllm-apc", "kvbackend")
SYSTEM_TOKENS, TURN_TOKENS, OUTPUT_TOKENS = 1500, 30, 16


def run(mode: str, model: str, args) -> dict:
    import vllm
    from vllm import SamplingParams

    import kvbackend.vllm

    kwargs = (kvbackend.vllm.engine_kwargs() if mode == "kvbackend"
              else {"enable_prefix_caching": mode == "vllm-apc"})
    llm = vllm.LLM(model=model, dtype="bfloat16", max_model_len=4096, enforce_eager=True,
                   block_size=32,  # vLLM raises it to 288, one state page
                   seed=0, kv_cache_memory_bytes=256 << 20,
                   max_num_batched_tokens=args.budget, **kwargs)
    rng = random.Random(5)
    words = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    system = words(SYSTEM_TOKENS)
    convos = [system + words(TURN_TOKENS) for _ in range(args.agents)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    reused = total = 0
    outputs, elapsed = [], 0.0
    try:
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            got = llm.generate([{"prompt_token_ids": c} for c in convos], params,
                               use_tqdm=False)
            elapsed += time.perf_counter() - t0
            for i, out in enumerate(got):
                reused, total = reused + (out.num_cached_tokens or 0), total + len(convos[i])
                tokens = list(out.outputs[0].token_ids)
                outputs.append(tokens)
                convos[i] = convos[i] + tokens + words(TURN_TOKENS)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"seconds": elapsed, "reused": reused, "total": total, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    args = parser.parse_args()

    from kvbackend.testing.tiny_model import build_tiny_qwen3_next

    with tempfile.TemporaryDirectory(prefix="kvb-hybrid-") as model_dir:
        model = build_tiny_qwen3_next(model_dir)
        results = {mode: run(mode, model, args) for mode in ENGINES}
    base = results["vllm-apc"]
    print(f"\n{args.agents} agents x {args.rounds} turns on a {SYSTEM_TOKENS}-token system "
          f"prompt, max_num_batched_tokens {args.budget}\n")
    print("| engine | batches (s) | time vs vllm-apc | prompt tokens reused | "
          "outputs = vllm-apc |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['seconds']:.2f} | {r['seconds'] / base['seconds']:.2f}x | "
              f"{r['reused']:,} of {r['total']:,} ({r['reused'] / r['total']:.1%}) | "
              f"{'yes' if r['outputs'] == base['outputs'] else 'no'} |")


if __name__ == "__main__":
    main()
