"""Scheduler-side cost: kvbackend's ``KVBackendManager`` vs vLLM's own ``KVCacheManager``.

What is measured
    Both managers are driven with the exact call sequence of vLLM 0.32's ``Scheduler``
    on identical synthetic request traces -- no model, no engine, no worker:

        step 0 (admission)   new_step_starts()
                             for each of the C requests:
                                 [vLLM only] request.update_block_hashes()   (engine core)
                                 get_computed_blocks(req)            -> blocks, hit
                                 allocate_slots(req, prompt - hit,
                                                num_new_computed_tokens=hit,
                                                new_computed_blocks=blocks,
                                                has_scheduled_reqs=...)
                                 record_prefix_cache_stats(req, hit)
                                 req.num_computed_tokens = hit; then += prompt - hit
                             take_kv_cache_block_copies()
        128 decode steps     new_step_starts()
                             for each request (round robin):
                                 req.append_output_token_ids(tok)   (update_from_output;
                                                                      rehashes new full blocks
                                                                      for vLLM)
                                 allocate_slots(req, 1); req.num_computed_tokens += 1
                             take_kv_cache_block_copies()
        end                  free(req) for each request

    vLLM's manager runs with enable_caching=True and the engine core's block hasher:
    ``get_request_block_hasher(block_size, sha256)`` after ``init_none_hash(sha256)``,
    as ``EngineCore`` sets it up with the default ``--prefix-caching-hash-algo sha256``.
    The per-request prompt hashing (which the engine core does when a request
    arrives) is timed as vLLM's "hashing" phase. kvbackend's requests carry no
    hasher (its engine kwargs turn vLLM's prefix caching, and hence hashing, off).
    ``KVBackendManager`` is built with the same keyword arguments as
    ``kvbackend/vllm/scheduler.py`` uses, plus ``backend_config=KVBackendConfig()``.

    Trace per prompt length L: one KV-cache group (full attention, block size 16),
    ``--waves`` waves of ``--concurrency`` requests (admit C, decode them round
    robin for ``--decode`` steps, free them; default: 2 waves, more for short prompts
    so that one run covers at least 256k prompt tokens and is not all timer noise);
    every prompt is a shared prefix of int(0.7 L) tokens (not block aligned) followed
    by a unique random suffix. Enough blocks that nothing is ever evicted. The first
    request of the first wave is cold; the rest of wave 1 are admitted in the same
    scheduler step as the cold one.

    Phases (microseconds per request, summed over the request's calls; the per-step
    new_step_starts / take_kv_cache_block_copies cost -- called for both managers, as
    the scheduler does -- is shared out over the C requests of the step and counted
    in "decode" (admission step: in "allocate")):
        hashing   vLLM only: request.update_block_hashes() at arrival
        lookup    get_computed_blocks
        allocate  the prompt's allocate_slots + admission-step bookkeeping
        decode    --decode x (append_output_token_ids + allocate_slots(req, 1)) + step calls
        free      free(req)
    Each length runs ``--repeats`` times with fresh managers; vLLM and kvbackend
    alternate within a repeat, so their ratio is measured side by side. Medians are
    reported. The garbage collector is off while timing (collected between runs).

    Hit tokens: what ``get_computed_blocks`` returned. "warm" = requests of waves >= 2
    (kvbackend: the shared length, token exact, capped at L - 1; vLLM: its block-aligned
    part); "same step" = wave-1 requests admitted in the same step as the cold request
    (kvbackend then cuts a partial-block hit back to the last full block, by design:
    the partial block is copied before the forward pass that writes it).

Run (from the repository root)
    .venv/bin/python benchmarks/bench_scheduler.py                 # default (< 3 minutes)
    .venv/bin/python benchmarks/bench_scheduler.py --quick         # a few seconds
    .venv/bin/python benchmarks/bench_scheduler.py --lengths 1024,8192 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import random
import statistics
import time

import torch

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.manager import KVBackendManager

BLOCK_SIZE = 16
SHARED_FRACTION = 0.7
VOCAB = 128_000
VLLM_PHASES = ("hashing", "lookup", "allocate", "decode", "free")
KVB_PHASES = ("lookup", "allocate", "decode", "free")
WAVE_TOKENS = 256 * 1024


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=64,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])


def make_vllm_manager(num_blocks: int, max_model_len: int) -> KVCacheManager:
    return KVCacheManager(
        kv_cache_config=kv_cache_config(num_blocks), max_model_len=max_model_len,
        max_in_flight_tokens=max_model_len, enable_caching=True, log_stats=False,
        scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE, watermark=0.0)


def make_kvbackend_manager(num_blocks: int, max_model_len: int) -> KVBackendManager:
    # Same keyword arguments as kvbackend/vllm/scheduler.py (metrics_collector is None
    # there unless KV-cache metrics are on).
    return KVBackendManager(
        kv_cache_config=kv_cache_config(num_blocks), max_model_len=max_model_len,
        max_in_flight_tokens=max_model_len, enable_caching=False, log_stats=False,
        scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE, metrics_collector=None,
        watermark=0.0, backend_config=KVBackendConfig())


def make_prompts(length: int, num_requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(int(SHARED_FRACTION * length))]
    # Suffixes start with distinct tokens, so no two prompts share more than the prefix.
    firsts = rng.sample(range(VOCAB), num_requests)
    return [shared + [first] + [rng.randrange(VOCAB) for _ in range(length - len(shared) - 1)]
            for first in firsts]


def run_trace(kind: str, prompts: list[list[int]], concurrency: int, decode: int,
              num_blocks: int, max_model_len: int, hasher, make=None) -> dict:
    """One pass over the trace with a fresh manager (``make(num_blocks, max_model_len)``,
    by default ``kind``'s); returns per-request phase sums and hits."""
    make = make or (make_vllm_manager if kind == "vllm" else make_kvbackend_manager)
    manager = make(num_blocks, max_model_len)
    params = SamplingParams(max_tokens=decode + 1)
    # Requests are built untimed and without a hasher; vLLM's hashing is timed below.
    requests = [Request(f"{kind}-{i}", list(p), params, None, block_hasher=None)
                for i, p in enumerate(prompts)]
    t = {phase: 0.0 for phase in VLLM_PHASES}
    hits: list[int] = []
    clock = time.perf_counter
    rng = random.Random(1)
    out_tokens = [[rng.randrange(VOCAB) for _ in range(decode)] for _ in requests]
    gc.collect()
    gc.disable()
    try:
        for w in range(0, len(requests), concurrency):
            wave = requests[w: w + concurrency]
            # ---- admission step
            t0 = clock()
            manager.new_step_starts()
            t["allocate"] += clock() - t0
            running = False
            for req in wave:
                if kind == "vllm":
                    req._block_hasher = hasher
                    t0 = clock()
                    req.update_block_hashes()
                    t["hashing"] += clock() - t0
                t0 = clock()
                blocks, hit, _ = manager.get_computed_blocks(req)
                t1 = clock()
                num_new = req.num_tokens - hit
                new_blocks = manager.allocate_slots(
                    req, num_new, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                    num_lookahead_tokens=0, num_external_computed_tokens=0,
                    delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=False,
                    reserved_blocks=0, has_scheduled_reqs=running)
                if new_blocks is not None:
                    manager.record_prefix_cache_stats(req, hit)
                t2 = clock()
                if new_blocks is None:
                    raise RuntimeError(f"{kind}: admission of {req.request_id} failed "
                                       "(pool too small)")
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = hit
                req.num_computed_tokens += num_new  # _update_after_schedule
                t["lookup"] += t1 - t0
                t["allocate"] += t2 - t1
                hits.append(hit)
                running = True
            t0 = clock()
            manager.take_kv_cache_block_copies()
            t["allocate"] += clock() - t0
            # ---- decode steps, round robin
            for step in range(decode):
                t0 = clock()
                manager.new_step_starts()
                for i, req in enumerate(wave):
                    req.append_output_token_ids(out_tokens[w + i][step])  # update_from_output
                    if manager.allocate_slots(req, 1, num_lookahead_tokens=0) is None:
                        raise RuntimeError(f"{kind}: decode allocation failed")
                    req.num_computed_tokens += 1
                manager.take_kv_cache_block_copies()
                t["decode"] += clock() - t0
            # ---- finish
            t0 = clock()
            for req in wave:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                manager.free(req)
            t["free"] += clock() - t0
    finally:
        gc.enable()
    if kind == "kvbackend":
        manager.cache.check_invariants()  # untimed sanity check
    n = len(requests)
    per_req = {phase: 1e6 * v / n for phase, v in t.items()}
    per_req["total"] = sum(per_req.values())
    return {"us": per_req, "hits": hits}


def waves_for(length: int, args) -> int:
    if args.waves is not None:
        return args.waves
    return max(2, -(-WAVE_TOKENS // (length * args.concurrency)))


def bench_length(length: int, args, hasher) -> dict:
    waves = waves_for(length, args)
    n = args.concurrency * waves
    prompts = make_prompts(length, n, seed=length)
    max_model_len = length + args.decode + 2 * BLOCK_SIZE
    # Every request's blocks stay cached after it ends: room for all of them, so nothing is evicted.
    num_blocks = n * (-(-max_model_len // BLOCK_SIZE)) + 2 * args.concurrency + 16
    runs = {"vllm": [], "kvbackend": []}
    for r in range(args.repeats):
        order = ("vllm", "kvbackend") if r % 2 == 0 else ("kvbackend", "vllm")
        for kind in order:
            runs[kind].append(run_trace(kind, prompts, args.concurrency, args.decode,
                                        num_blocks, max_model_len, hasher))
    result = {"length": length, "shared_tokens": int(SHARED_FRACTION * length), "waves": waves,
              "num_requests": n, "num_blocks": num_blocks}
    for kind, phases in (("vllm", VLLM_PHASES), ("kvbackend", KVB_PHASES)):
        us = {p: statistics.median(run["us"][p] for run in runs[kind]) for p in (*phases, "total")}
        hits = runs[kind][0]["hits"]
        result[kind] = {
            "us": us,
            "hit_cold": hits[0],
            "hit_same_step": sorted(set(hits[1: args.concurrency])),
            "hit_warm": sorted(set(hits[args.concurrency:])),
        }
    result["ratio"] = statistics.median(
        k["us"]["total"] / v["us"]["total"] for k, v in zip(runs["kvbackend"], runs["vllm"]))
    return result


def fmt_hits(values: list[int]) -> str:
    return "/".join(str(v) for v in values) if values else "-"


def print_table(results: list[dict], args) -> None:
    print(f"\nScheduler-side cost per request, µs (median of {args.repeats}; "
          f"block size {BLOCK_SIZE}, "
          f"{args.concurrency} concurrent requests per wave, {args.decode} decode steps, "
          f"{int(SHARED_FRACTION * 100)}% shared prefix; kvb / vLLM = median of the per-repeat "
          "ratios of totals, vLLM and kvbackend alternating within each repeat)\n")
    print("| prompt tokens | waves | vLLM hashing | vLLM lookup | vLLM allocate | vLLM decode "
          "| vLLM free "
          "| **vLLM total** | kvb lookup | kvb allocate | kvb decode | kvb free | **kvb total** "
          "| **kvb / vLLM** |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        v, k = r["vllm"]["us"], r["kvbackend"]["us"]
        cells = [f"{r['length']:,}", str(r["waves"])] + [f"{v[p]:.0f}" for p in VLLM_PHASES]
        cells += [f"**{v['total']:.0f}**"]
        cells += [f"{k[p]:.0f}" for p in KVB_PHASES]
        cells += [f"**{k['total']:.0f}**", f"**{r['ratio']:.2f}**"]
        print("| " + " | ".join(cells) + " |")
    print("\nHit tokens returned by get_computed_blocks (warm = waves >= 2; "
          "same step = rest of wave 1, "
          "admitted in the cold request's step)\n")
    print("| prompt tokens | shared tokens | vLLM warm | kvb warm | vLLM same step "
          "| kvb same step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        v, k = r["vllm"], r["kvbackend"]
        print(f"| {r['length']:,} | {r['shared_tokens']:,} | {fmt_hits(v['hit_warm'])} | "
              f"{fmt_hits(k['hit_warm'])} | {fmt_hits(v['hit_same_step'])} | "
              f"{fmt_hits(k['hit_same_step'])} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,8192,32768,131072",
                        help="comma-separated prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--waves", type=int, default=None,
                        help="waves of --concurrency requests (default: at least 2, and enough for "
                             f"{WAVE_TOKENS:,} prompt tokens per run, so short prompts are not "
                             "all noise)")
    parser.add_argument("--decode", type=int, default=128, help="decode steps per request")
    parser.add_argument("--quick", action="store_true", help="lengths 1024,8192; 3 repeats")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats = "1024,8192", 3
    lengths = [int(x) for x in args.lengths.split(",")]
    logging.getLogger("vllm").setLevel(logging.WARNING)

    hash_fn = get_hash_fn_by_name("sha256")  # --prefix-caching-hash-algo default
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)

    # Untimed warm-up of both code paths (imports, numba's compiled helpers, caches).
    warm = make_prompts(1024, args.concurrency, seed=0)
    for kind in ("vllm", "kvbackend"):
        run_trace(kind, warm, args.concurrency, args.decode, 4 * 1024, 2048, hasher)

    start = time.perf_counter()
    results = []
    for length in lengths:
        t0 = time.perf_counter()
        results.append(bench_length(length, args, hasher))
        print(f"  length {length:,}: {time.perf_counter() - t0:.1f} s", flush=True)
    print_table(results, args)
    wall = time.perf_counter() - start
    print(f"\nwall time {wall:.1f} s; python {platform.python_version()}, {platform.machine()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "wall_s": wall, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
