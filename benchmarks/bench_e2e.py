"""End to end: one shared system prompt, many questions, three vLLM engines side by side.

What is measured
    A random-weight Llama (``kvbackend.testing.tiny_model.build_tiny_llama``, float32;
    default hidden 512, 8 layers, 8 heads of 64, intermediate 1024, vocab 512) serves
    one ``LLM.generate`` batch: a ``--system-tokens`` (2000) token system prompt shared by
    ``--questions`` (24) questions of ``--question-tokens`` (48) tokens each, greedy,
    ``--output-tokens`` (8) output tokens per request. Prompts are token ids (random,
    seeded). Three engines run one after another in one process, each shut down before
    the next starts:

        no-cache    vLLM, enable_prefix_caching=False
        vllm-apc    vLLM's own prefix caching (enable_prefix_caching=True; CPU default
                    block size 128, so it reuses the block-aligned part of the prompt)
        kvbackend   **kvbackend.vllm.engine_kwargs() (token-exact; block size 128)

    ``--eagle`` gives every engine a random EAGLE drafter of the model's sizes (3 draft
    tokens; random, so it is rarely right): vLLM's prefix caching then drops a hit's
    last block, kvbackend's hit ends one token before its match (the drafter's KV at a
    position reads the next token).
    ``--async-scheduling on|off`` sets vLLM's ``async_scheduling`` for all three alike
    (``engine_kwargs()`` without a tier leaves it alone, so kvbackend runs under the
    same setting, with its ``KVBackendAsyncScheduler`` when on); ``default`` (the
    default) leaves vLLM's own choice (a GPU build: on; the CPU build: off). Each
    engine's setting as vLLM settled it is reported, and a run stops if it is not
    the one asked for. ``--dry-run`` prints each engine's keyword arguments and
    starts nothing.
    All run with enforce_eager=True and a KV cache sized so the whole batch fits
    without prefix sharing (``kv_cache_memory_bytes``). Before the timed batch each
    engine serves one unrelated short prompt (warm-up; it shares no token with the
    system prompt, so nothing of the batch is cached beforehand: the batch computes
    the system prompt once itself).

    Reported per engine: engine start-up time, batch wall time (the ``generate`` call),
    mean ``num_cached_tokens`` per request, shared-token reuse (mean of
    num_cached_tokens / system tokens over the requests after the first), the batch
    time relative to vllm-apc, and whether the greedy outputs of all three engines
    are identical token for token (mismatches are printed). Absolute times are noisy
    on shared machines; compare the ratios, which are measured in one run.

Run (from the repository root)
    .venv/bin/python benchmarks/bench_e2e.py             # default: ~5 minutes (3 engine starts)
    .venv/bin/python benchmarks/bench_e2e.py --quick     # 1000-token system prompt, 8 questions,
                                                          # hidden 256, 4 layers
    .venv/bin/python benchmarks/bench_e2e.py --engines vllm-apc,kvbackend --json out.json
    .venv/bin/python benchmarks/bench_e2e.py --async-scheduling on   # a GPU build, e.g.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

ENGINES = ("no-cache", "vllm-apc", "kvbackend")
FIRST_WORD_ID = 3  # ids 0-2 are <unk> <s> </s> in the tiny model's vocabulary


def model_params(args) -> dict:
    if args.quick:
        return dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                    intermediate_size=512, vocab_size=512)
    return dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                intermediate_size=1024, vocab_size=512)


def make_prompts(args, vocab_size: int) -> tuple[list[int], list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    words = range(FIRST_WORD_ID, vocab_size)
    system = [rng.choice(words) for _ in range(args.system_tokens)]
    prompts = [system + [rng.choice(words) for _ in range(args.question_tokens)]
               for _ in range(args.questions)]
    # The warm-up prompt shares not even its first token with the batch's prompts.
    warm_words = [w for w in words if w != system[0]]
    warm = [rng.choice(warm_words) for _ in range(16)]
    return system, prompts, warm


def kv_cache_bytes(params: dict, args) -> int:
    """Room for every request of the batch without any sharing, plus 25%, in MiB."""
    head_dim = params["hidden_size"] // params["num_heads"]
    per_token = 2 * params["num_layers"] * params["num_kv_heads"] * head_dim * 4  # K+V, float32
    tokens = args.questions * (args.system_tokens + args.question_tokens + args.output_tokens + 128)
    return -(-int(1.25 * tokens * per_token) // (1 << 20)) << 20


def engine_kwargs(mode: str, model_dir: str, args, kv_bytes: int,
                  drafter: str | None = None) -> dict:
    """The ``vllm.LLM`` keyword arguments of engine ``mode`` (EAGLE drafts by ``drafter``)."""
    import kvbackend.vllm

    max_len = args.system_tokens + args.question_tokens + args.output_tokens + 256
    kwargs = dict(model=model_dir, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=max_len, kv_cache_memory_bytes=kv_bytes)
    if drafter is not None:
        kwargs["speculative_config"] = {"method": "eagle", "model": drafter,
                                        "num_speculative_tokens": 3}
    if mode == "kvbackend":
        kwargs.update(kvbackend.vllm.engine_kwargs())
    else:
        kwargs["enable_prefix_caching"] = mode == "vllm-apc"
    if args.async_scheduling != "default":
        wanted = args.async_scheduling == "on"
        if kwargs.get("async_scheduling", wanted) != wanted:
            raise SystemExit(f"{mode}: its engine arguments set async_scheduling="
                             f"{kwargs['async_scheduling']}, --async-scheduling asks {wanted}")
        kwargs["async_scheduling"] = wanted
    return kwargs


def run_engine(mode: str, model_dir: str, prompts, warm, args, kv_bytes: int,
               drafter: str | None) -> dict:
    import vllm
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = vllm.LLM(**engine_kwargs(mode, model_dir, args, kv_bytes, drafter))
    startup = time.perf_counter() - t0
    async_scheduling = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    if args.async_scheduling != "default" and async_scheduling != (args.async_scheduling == "on"):
        llm.llm_engine.engine_core.shutdown()
        raise SystemExit(f"{mode}: vLLM settled async scheduling "
                         f"{'on' if async_scheduling else 'off'}, --async-scheduling asked "
                         f"{args.async_scheduling}")
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        batch = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    cached = [o.num_cached_tokens or 0 for o in outputs]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    reuse = [c / args.system_tokens for c in cached[1:]]
    return {"startup_s": startup, "batch_s": batch, "num_cached_tokens": cached,
            "async_scheduling": async_scheduling,
            "mean_cached": statistics.fmean(cached),
            "reuse": statistics.fmean(reuse) if reuse else 0.0,
            "outputs": tokens}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1000-token system prompt, 8 questions, hidden 256, 4 layers")
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--questions", type=int)
    parser.add_argument("--question-tokens", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {','.join(ENGINES)} (run in this order)")
    parser.add_argument("--model-dir", help="where to build / reuse the random model "
                        "(default: /tmp/kvbackend-bench-e2e-<size>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", choices=("on", "off", "default"),
                        default="default",
                        help="vLLM's async_scheduling for every engine (default: vLLM's choice)")
    parser.add_argument("--eagle", action="store_true",
                        help="every engine drafts with a random EAGLE drafter (3 tokens)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each engine's keyword arguments; start no engine")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.system_tokens is None:
        args.system_tokens = 1000 if args.quick else 2000
    if args.questions is None:
        args.questions = 8 if args.quick else 24
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from kvbackend.testing.tiny_model import build_tiny_eagle, build_tiny_llama

    params = model_params(args)
    model_dir = args.model_dir or f"/tmp/kvbackend-bench-e2e-{'quick' if args.quick else 'default'}"
    build_tiny_llama(model_dir, max_position_embeddings=8192, **params)
    sizes = {k: v for k, v in params.items() if k != "num_layers"}
    drafter = build_tiny_eagle(f"{model_dir}-eagle", **sizes) if args.eagle else None
    system, prompts, warm = make_prompts(args, params["vocab_size"])
    kv_bytes = kv_cache_bytes(params, args)
    if args.dry_run:
        for mode in engines:
            print(f"{mode}: {engine_kwargs(mode, model_dir, args, kv_bytes, drafter)}")
        return
    print(f"model {params}; KV cache {kv_bytes >> 20} MiB; "
          f"{args.questions} x ({args.system_tokens} shared + {args.question_tokens}) tokens, "
          f"{args.output_tokens} output tokens each", flush=True)

    start = time.perf_counter()
    results: dict[str, dict] = {}
    for mode in engines:
        t0 = time.perf_counter()
        results[mode] = run_engine(mode, model_dir, prompts, warm, args, kv_bytes, drafter)
        r = results[mode]
        print(f"  {mode}: start-up {r['startup_s']:.1f} s, batch {r['batch_s']:.2f} s "
              f"(engine total {time.perf_counter() - t0:.1f} s, async scheduling "
              f"{'on' if r['async_scheduling'] else 'off'})", flush=True)

    # ---- outputs must agree token for token
    mismatches = []
    ref_mode = engines[0] if engines else None
    for mode in engines[1:]:
        for i, (a, b) in enumerate(zip(results[ref_mode]["outputs"], results[mode]["outputs"])):
            if a != b:
                mismatches.append((mode, i, a, b))
    identical = not mismatches

    apc = results.get("vllm-apc")
    print(f"\nOne generate batch: {args.questions} requests = {args.system_tokens}-token shared "
          f"system prompt + {args.question_tokens}-token question, "
          f"{args.output_tokens} output tokens "
          f"(model hidden {params['hidden_size']}, {params['num_layers']} layers, float32"
          f"{'; EAGLE drafts' if args.eagle else ''})\n")
    print("| engine | start-up (s) | batch wall time (s) | mean num_cached_tokens "
          "| shared-token reuse "
          "(requests 2..n) | batch time vs vllm-apc |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in engines:
        r = results[mode]
        ratio = f"{r['batch_s'] / apc['batch_s']:.2f}x" if apc else "-"
        print(f"| {mode} | {r['startup_s']:.1f} | {r['batch_s']:.2f} | {r['mean_cached']:.1f} | "
              f"{100 * r['reuse']:.1f}% | {ratio} |")
    names = ", ".join(engines)
    print(f"\nOutputs identical across {names}: {'yes' if identical else 'NO'}"
          f" ({args.questions} requests x {args.output_tokens} tokens)")
    for mode, i, a, b in mismatches:
        print(f"  MISMATCH request {i}: {ref_mode} {a} vs {mode} {b}")
    for mode in engines:
        print(f"  num_cached_tokens {mode}: {results[mode]['num_cached_tokens']}")
    wall = time.perf_counter() - start
    print(f"\nwall time {wall:.1f} s (three engine start-ups included); python "
          f"{platform.python_version()}, {platform.machine()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "model": params, "kv_cache_bytes": kv_bytes,
                       "wall_s": wall, "identical": identical,
                       "mismatches": [list(m) for m in mismatches], "results": results},
                      f, indent=2)
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
