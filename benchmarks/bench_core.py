"""Throughput of the kvbackend core (PrefixCache: match + insert + evict) on synthetic traces.

What is measured
    Every request runs the full life cycle through ``PrefixCache``, each phase timed
    with ``time.perf_counter`` (garbage collector off while timing):
        evict    cache.evict(...) until a worst-case request (prompt + decode) fits in
                 free blocks (admission watermark: open_sequence never evicts itself);
        match    cache.match(prompt);
        open     cache.open_sequence(match, len(prompt)) + take/complete_block_copies;
        cache    cache.cache(seq, prompt)  (the radix-tree insert);
        decode   --decode single-token cache.extend calls;
        release  cache.release(seq).
    The pool holds about 4 worst-case requests (block size --block-size), so the tree
    fills up and eviction runs in steady state. Traces (arrays of the core's token
    dtype, int64, built once outside the timed region, numpy seed --seed):
        shared     one common prefix (70% of the length) + a unique random suffix;
        multiturn  conversations of 8 turns; each turn extends the previous prompt by
                   length/8 tokens (a full hit on the previous turn); last turn = length;
        random     unrelated random prompts: no reuse, every admission evicts.
    A trace has --token-budget / length requests, clamped to [16, --max-requests].
    Each (trace, length) runs --repeats times on a fresh cache; medians are reported:
    requests/s, prompt tokens/s, hit rate (matched / prompt tokens), microseconds per
    request and phase, evicted blocks per request; plus, apart, the one-off cost of
    ``as_token_array`` on a Python list (what engines hand over). check_invariants()
    runs after each trace (untimed), so the benchmark doubles as a sanity check.

Run (from the repository root)
    .venv/bin/python benchmarks/bench_core.py              # default run (make bench)
    .venv/bin/python benchmarks/bench_core.py --quick      # a few seconds
    .venv/bin/python benchmarks/bench_core.py --lengths 1024,8192 --block-size 32 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
import timeit

import numpy as np
from bench_args import int_list, trace_parser

from kvbackend.core import PrefixCache, as_token_array, cdiv
from kvbackend.core.token_ops import TOKEN_DTYPE

TRACES = ("shared", "multiturn", "random")
PHASES = ("match", "open", "cache", "decode", "release", "evict")
VOCAB = 128_000
TURNS = 8
SHARED_FRACTION = 0.7
POOL_PROMPTS = 4


def make_trace(kind: str, length: int, num_requests: int, rng: np.random.Generator) -> list:
    def rand(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, n).astype(TOKEN_DTYPE)

    if kind == "shared":
        prefix = rand(int(SHARED_FRACTION * length))
        return [np.concatenate([prefix, rand(length - len(prefix))]) for _ in range(num_requests)]
    if kind == "multiturn":
        step = max(1, length // TURNS)
        convs = [rand(step * TURNS) for _ in range(max(1, num_requests // TURNS))]
        return [conv[: step * (turn + 1)] for conv in convs for turn in range(TURNS)]
    return [rand(length) for _ in range(num_requests)]


def run_once(prompts: list, num_blocks: int, block_size: int, decode: int, check: bool) -> dict:
    """Drive every prompt through one fresh PrefixCache; returns summed phase times."""
    cache = PrefixCache(num_blocks, block_size)
    clock = time.perf_counter
    t_match = t_open = t_cache = t_decode = t_release = t_evict = 0.0
    hit = evicted = 0
    gc.collect()
    gc.disable()
    try:
        start = clock()
        for prompt in prompts:
            n = len(prompt)
            t0 = clock()
            need = cdiv(n + decode, block_size)
            if cache.pool.num_free < need:
                evicted += cache.evict(need - cache.pool.num_free)
            t1 = clock()
            m = cache.match(prompt)
            t2 = clock()
            seq = cache.open_sequence(m, n)
            if seq is None:
                raise RuntimeError("pool exhausted despite the admission watermark")
            cache.take_block_copies()  # an engine runs these copies on the device, then:
            cache.complete_block_copies()
            t3 = clock()
            cache.cache(seq, prompt)
            t4 = clock()
            for k in range(n + 1, n + decode + 1):
                cache.extend(seq, k)
            t5 = clock()
            cache.release(seq)
            t6 = clock()
            hit += m.num_tokens
            t_evict += t1 - t0
            t_match += t2 - t1
            t_open += t3 - t2
            t_cache += t4 - t3
            t_decode += t5 - t4
            t_release += t6 - t5
        total = clock() - start
    finally:
        gc.enable()
    if check:
        cache.check_invariants()
        assert not cache.sequences, "a sequence outlived its release"
        tree_evicted = sum(s.evicted_blocks for s in cache.tree.stats.values())
        assert tree_evicted == evicted, f"hidden eviction: {tree_evicted} != {evicted}"
    return {"total": total, "match": t_match, "open": t_open, "cache": t_cache, "decode": t_decode,
            "release": t_release, "evict": t_evict, "hit": hit, "evicted": evicted}


def pool_blocks(length: int, args: argparse.Namespace) -> int:  # + 1: the null block
    return POOL_PROMPTS * cdiv(length + args.decode, args.block_size) + 1


def bench(kind: str, length: int, args: argparse.Namespace) -> dict:
    """Median of --repeats runs of one trace at one prompt length."""
    rng = np.random.default_rng([args.seed, length, TRACES.index(kind)])
    num_requests = max(16, min(args.max_requests, args.token_budget // length))
    prompts = make_trace(kind, length, num_requests, rng)
    prompt_tokens, n, num_blocks = sum(map(len, prompts)), len(prompts), pool_blocks(length, args)
    runs = [run_once(prompts, num_blocks, args.block_size, args.decode, r == args.repeats - 1)
            for r in range(args.repeats)]
    med = {key: statistics.median(run[key] for run in runs) for key in ("total", *PHASES)}
    return {  # hit / evicted counts are deterministic: the same in every run
        "trace": kind, "length": length, "requests": n, "prompt_tokens": prompt_tokens,
        "num_blocks": num_blocks, "block_size": args.block_size, "repeats": args.repeats,
        "requests_per_s": n / med["total"], "tokens_per_s": prompt_tokens / med["total"],
        "hit_rate": runs[0]["hit"] / prompt_tokens,
        "evicted_blocks_per_request": runs[0]["evicted"] / n,
        "us_per_request": {p: 1e6 * med[p] / n for p in PHASES},
        "total_s_runs": [run["total"] for run in runs],
    }


def bench_conversion(length: int, repeats: int, seed: int) -> dict:
    tokens = np.random.default_rng([seed, length]).integers(0, VOCAB, length).tolist()
    med = statistics.median(timeit.repeat(lambda: as_token_array(tokens), number=1,
                                          repeat=max(5, repeats)))
    return {"length": length, "us": 1e6 * med, "ns_per_token": 1e9 * med / length}


def print_tables(results: list[dict], conversions: list[dict]) -> None:
    cols = ["trace", "tokens", "reqs", "req/s", "Mtok/s", "hit rate",
            *(f"{p} µs" for p in PHASES), "evicted blk/req"]
    print("| " + " | ".join(cols) + " |\n|---|" + "---:|" * (len(cols) - 1))
    for r in results:
        us = r["us_per_request"]
        row = [r["trace"], f"{r['length']:,}", str(r["requests"]), f"{r['requests_per_s']:,.0f}",
               f"{r['tokens_per_s'] / 1e6:,.1f}", f"{r['hit_rate']:.3f}",
               *(f"{us[p]:,.1f}" for p in PHASES), f"{r['evicted_blocks_per_request']:,.1f}"]
        print("| " + " | ".join(row) + " |")
    print("\n| tokens | as_token_array(list) µs | ns/token |\n|---:|---:|---:|")
    for c in conversions:
        print(f"| {c['length']:,} | {c['us']:,.1f} | {c['ns_per_token']:.1f} |")


def main() -> None:
    parser = trace_parser(__doc__, token_budget=1 << 23, max_requests=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="small run: 1k and 8k, fewer requests")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.token_budget, args.max_requests = "1024,8192", 1 << 18, 64
    lengths = int_list(args.lengths)
    warm_up = make_trace("shared", 256, 16, np.random.default_rng(args.seed))  # numba JIT/cache
    run_once(warm_up, pool_blocks(256, args), args.block_size, args.decode, check=True)
    started = time.perf_counter()
    results = [bench(kind, length, args) for kind in TRACES for length in lengths]
    conversions = [bench_conversion(length, args.repeats, args.seed) for length in lengths]
    elapsed = time.perf_counter() - started
    print_tables(results, conversions)
    print(f"\nblock_size {args.block_size}, pool ~{POOL_PROMPTS} requests, decode {args.decode}, "
          f"median of {args.repeats}; {elapsed:.1f} s; invariants checked after every trace")
    if args.json:
        meta = {key: value for key, value in vars(args).items() if key != "json"}
        meta.update(python=platform.python_version(), numpy=np.__version__, elapsed_s=elapsed)
        report = {"config": meta, "results": results, "as_token_array": conversions}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
