"""Models with several KV-cache groups in vLLM (CPU): kvbackend beside vLLM's prefix caching.

    python benchmarks/bench_hybrid.py [--model qwen3-next|gemma3] [--rounds 4] [--agents 8]
                                      [--budget 2048] [--kv-cache-mib 256] [--host-cache-gb 0]
                                      [--context-tokens 0]

Models (tiny, random weights, built locally):

    qwen3-next  a Mamba / linear-attention hybrid (``build_tiny_qwen3_next``: one Gated
                DeltaNet layer, one full-attention layer, bfloat16; vLLM fits one state
                page in a 288-token block)
    gemma3      interleaved sliding-window and full attention (``build_tiny_gemma3``: two
                64-token-window layers, one full layer, float32, 32-token blocks)

Workload: ``--agents`` conversations on one 1,500-token system prompt (then, with
``--context-tokens``, a document of that many tokens of each agent's own), each turn
adding the 16 greedy output tokens and a 30-token user message, ``--rounds`` turns, every
turn one ``LLM.generate`` batch, in ``--kv-cache-mib`` of KV cache. Engines, one after
another in this process:

    no-cache        vLLM, enable_prefix_caching=False
    vllm-apc        vLLM's prefix caching ("align" mode for the state layers)
    kvbackend       kvbackend.vllm.engine_kwargs() (the same "align" mode, kvbackend's tree)
    kvbackend+host  the same with a ``--host-cache-gb`` host tier (when above 0; gemma3:
                    kvbackend's tiers are refused with state layers)

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

SYSTEM_TOKENS, TURN_TOKENS, OUTPUT_TOKENS = 1500, 30, 16
DTYPES = {"qwen3-next": "bfloat16", "gemma3": "float32"}


def engine_options(mode: str, args) -> dict:
    """The engine's prefix-caching keyword arguments."""
    import kvbackend.vllm

    if mode == "kvbackend+host":
        return kvbackend.vllm.engine_kwargs(host_cache_gb=args.host_cache_gb)
    if mode == "kvbackend":
        return kvbackend.vllm.engine_kwargs()
    return {"enable_prefix_caching": mode == "vllm-apc"}


def run(mode: str, model: str, args) -> dict:
    import vllm
    from vllm import SamplingParams

    llm = vllm.LLM(model=model, dtype=DTYPES[args.model], max_model_len=args.max_model_len,
                   enforce_eager=True,
                   block_size=32,  # qwen3-next: vLLM raises it to 288, one state page
                   seed=0, kv_cache_memory_bytes=args.kv_cache_mib << 20,
                   max_num_batched_tokens=args.budget, **engine_options(mode, args))
    rng = random.Random(5)
    words = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    system = words(SYSTEM_TOKENS)
    convos = [system + words(args.context_tokens + TURN_TOKENS) for _ in range(args.agents)]
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
    parser.add_argument("--model", choices=sorted(DTYPES), default="qwen3-next")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--host-cache-gb", type=float, default=0.0)
    parser.add_argument("--context-tokens", type=int, default=0,
                        help="each agent's own document after the system prompt")
    args = parser.parse_args()

    from kvbackend.testing.tiny_model import build_tiny_gemma3, build_tiny_qwen3_next

    engines = ["no-cache", "vllm-apc", "kvbackend"] + (
        ["kvbackend+host"] if args.host_cache_gb > 0 else [])
    build = build_tiny_gemma3 if args.model == "gemma3" else build_tiny_qwen3_next
    with tempfile.TemporaryDirectory(prefix="kvb-hybrid-") as model_dir:
        model = build(model_dir)
        results = {mode: run(mode, model, args) for mode in engines}
    base = results["vllm-apc"]
    print(f"\n{args.model}: {args.agents} agents x {args.rounds} turns on a {SYSTEM_TOKENS}-"
          f"token system prompt (+ {args.context_tokens} own), max_num_batched_tokens "
          f"{args.budget}, "
          f"{args.kv_cache_mib} MiB of KV cache\n")
    print("| engine | batches (s) | time vs vllm-apc | prompt tokens reused | "
          "outputs = vllm-apc |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['seconds']:.2f} | {r['seconds'] / base['seconds']:.2f}x | "
              f"{r['reused']:,} of {r['total']:,} ({r['reused'] / r['total']:.1%}) | "
              f"{'yes' if r['outputs'] == base['outputs'] else 'no'} |")


if __name__ == "__main__":
    main()
