"""Scheduler-side cost of kvbackend's SGLang radix cache against SGLang's own RadixCache.

What is measured
    Every request goes through the calls SGLang's scheduler makes on its tree cache,
    on SGLang's real classes (Req, ReqToTokenPool, MHATokenToKVPool on device "cpu",
    TokenToKVPoolAllocator at page size 1, PagedTokenToKVPoolAllocator otherwise), one
    request at a time, each phase timed (garbage collector off) in CPU time of this
    process (time.process_time, so other processes on a shared machine do not count;
    --wall: time.perf_counter):
        match       Req.init_next_round_input: match_kv_cache -> match_prefix
        lock        tree_cache.lock(req.last_node) + prefix_device_indices(req)
        checkpoint  checkpoint_kv_cache after every prefill chunk but the last
                    (--chunk tokens per chunk, SGLang's chunked prefill)
        release     release_kv_cache(req, checkpoint=True) after --decode output tokens
        evict       allocator.evict_to_free_tokens(tree_cache, n) before every allocation
    The allocation itself and the row writes are the same code for both caches and
    are not timed. The KV pool holds about 4 prompts, so eviction runs in steady state.
    torch runs single-threaded (a scheduler's row and index tensors live on the GPU;
    here, on the CPU, idle OpenMP threads would spin and count as CPU time).
    Traces (numpy seed --seed, built outside the timed region):
        shared     a system prompt of 70% of the length + a unique question;
        multiturn  conversations of 8 turns; each turn's prompt is the previous one,
                   its output and a new user message (a full hit on the previous turn).
    Each configuration runs --repeats times on fresh pools, the two caches alternating
    (after a warm-up that compiles kvbackend's numba kernels);
    the medians are reported as µs per request, and kvbackend / SGLang (< 1: faster).
    Both caches must report the same hit tokens (checked), and their pool accounting
    must balance after each run (SGLang's leak check).

Run (from the repository root, in the SGLang environment)
    .venv-sglang/bin/python benchmarks/bench_sglang.py              # full run
    .venv-sglang/bin/python benchmarks/bench_sglang.py --quick      # 1k and 8k, a minute
    .venv-sglang/bin/python benchmarks/bench_sglang.py --lengths 32768 --page-sizes 1 --json o.json
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import warnings
from array import array

import numpy as np
import torch
from bench_args import int_list, trace_parser

warnings.filterwarnings("ignore", message="Only CUDA, MUSA and NPU support GGUF")

from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.managers.scheduler_components.invariant_checker import (  # noqa: E402
    SchedulerInvariantChecker,
)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvbackend.core import cdiv  # noqa: E402
from kvbackend.sglang.radix_cache import KVBackendRadixCache  # noqa: E402

CACHES = {"SGLang": RadixCache, "kvbackend": KVBackendRadixCache}
TRACES = ("shared", "multiturn")
PHASES = ("match", "lock", "checkpoint", "release", "evict")
VOCAB = 128_000
TURNS = 8
SHARED_FRACTION = 0.7
POOL_PROMPTS = 4


def make_trace(kind: str, length: int, num_requests: int, decode: int,
               rng: np.random.Generator) -> list[tuple[array, array]]:
    """(prompt, output) token arrays per request."""
    def rand(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, n)

    if kind == "shared":
        system = rand(int(SHARED_FRACTION * length))
        prompts = [np.concatenate([system, rand(length - len(system))])
                   for _ in range(num_requests)]
        pairs = [(p, rand(decode)) for p in prompts]
    else:  # turn t's prompt: the conversation so far; its output: the next tokens
        step = max(1, length // TURNS)
        pairs = []
        for _ in range(max(1, num_requests // TURNS)):
            conv = rand(step * TURNS + decode)
            pairs += [(conv[: step * (t + 1)], conv[step * (t + 1): step * (t + 1) + decode])
                      for t in range(TURNS)]
    return [(array("q", p.tobytes()), array("q", o.tobytes())) for p, o in pairs]


class Scheduler:
    """SGLang's per-request call sequence on one tree cache, one request at a time."""

    def __init__(self, cache_cls, page_size: int, max_len: int, args) -> None:
        ps = page_size
        num_slots = (POOL_PROMPTS * (max_len + ps)) // ps * ps
        self.page_size, self.chunk = ps, args.chunk
        self.rows = ReqToTokenPool(size=2, max_context_len=max_len + ps, device="cpu",
                                   enable_memory_saver=False)
        kv = MHATokenToKVPool(size=num_slots, page_size=ps, dtype=torch.float16, head_num=1,
                              head_dim=1, layer_num=1, device="cpu", enable_memory_saver=False)
        if ps == 1:
            self.allocator = TokenToKVPoolAllocator(size=num_slots, dtype=torch.float16,
                                                    device="cpu", kvcache=kv, need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(size=num_slots, page_size=ps,
                                                         dtype=torch.float16, device="cpu",
                                                         kvcache=kv, need_sort=False)
        self.cache = cache_cls(CacheInitParams(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.allocator,
            page_size=ps))
        self.times = dict.fromkeys(PHASES, 0.0)
        self.hit_tokens = 0
        self.clock = time.perf_counter if args.wall else time.process_time

    def run(self, rid: str, prompt: array, output: array) -> None:
        clock, t = self.clock, self.times
        req = Req(rid, "", prompt, SamplingParams(max_new_tokens=len(output)))
        t0 = clock()
        req.init_next_round_input(self.cache)
        t1 = clock()
        req.lock = self.cache.lock(req.last_node)
        prefix = self.cache.prefix_device_indices(req)
        t2 = clock()
        t["match"] += t1 - t0
        t["lock"] += t2 - t1
        self.hit_tokens += req.prefix_len
        self.rows.alloc([req])
        self.rows.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix.to(torch.int32))
        start = req.prefix_len
        while start < len(prompt):  # chunked prefill
            end = min(start + self.chunk, len(prompt))
            self._extend(req, start, end)
            req.extend_end = end
            if end < len(prompt):
                t0 = clock()
                checkpoint_kv_cache(req, self.cache)
                t["checkpoint"] += clock() - t0
            start = end
        self._extend(req, len(prompt), len(prompt) + len(output))  # the decode steps' slots
        req.output_ids.extend(output)
        req.finished_reason = FINISH_LENGTH(length=len(output))
        t0 = clock()
        release_kv_cache(req, self.cache, checkpoint=True)
        t["release"] += clock() - t0

    def _extend(self, req: Req, start: int, end: int) -> None:
        """Slots for row positions [start, end): eviction timed, allocation not."""
        ps, row = self.page_size, req.kv.req_pool_idx
        need = (cdiv(end, ps) - cdiv(start, ps)) * ps
        t0 = self.clock()
        self.allocator.evict_to_free_tokens(self.cache, need)
        self.times["evict"] += self.clock() - t0
        if ps == 1:
            slots = self.allocator.alloc(end - start)
        else:
            last = self.rows.req_to_token[row, start - 1:start].to(torch.int64) if start \
                else torch.tensor([-1])
            lens = torch.tensor([start]), torch.tensor([end])
            slots = self.allocator.alloc_extend(lens[0], lens[0], lens[1], lens[1], last,
                                                end - start)
        if slots is None:
            raise RuntimeError("the KV pool cannot fit one request")
        self.rows.write((row, slice(start, end)), slots.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end

    def check(self) -> None:
        """SGLang's leak check with no request running; kvbackend's own invariants."""
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", available=self.allocator.available_size(),
            evictable=self.cache.evictable_size(), protected=self.cache.protected_size(),
            session_held=0, total=self.allocator.size, uncached=0)
        assert not leak and self.cache.protected_size() == 0, msg
        if isinstance(self.cache, KVBackendRadixCache):
            self.cache.check_invariants()


def run_once(cache_cls, page_size: int, trace: list, args) -> dict:
    max_len = max(len(p) + len(o) for p, o in trace)
    sched = Scheduler(cache_cls, page_size, max_len, args)
    gc.collect()
    gc.disable()
    try:
        for i, (prompt, output) in enumerate(trace):
            sched.run(f"r{i}", prompt, output)
    finally:
        gc.enable()
    sched.check()
    return {**sched.times, "total": sum(sched.times.values()), "hit": sched.hit_tokens}


def bench(kind: str, length: int, page_size: int, args) -> dict:
    rng = np.random.default_rng([args.seed, length, TRACES.index(kind)])
    num_requests = max(TURNS, min(args.max_requests, args.token_budget // length))
    trace = make_trace(kind, length, num_requests, args.decode, rng)
    runs = {name: [] for name in CACHES}
    for _ in range(args.repeats):
        for name, cls in CACHES.items():
            runs[name].append(run_once(cls, page_size, trace, args))
    hits = {name: r[0]["hit"] for name, r in runs.items()}
    if len(set(hits.values())) != 1:
        raise AssertionError(f"the caches disagree on hit tokens: {hits}")
    per_req = {name: {p: 1e6 * statistics.median(run[p] for run in r) / len(trace)
                      for p in (*PHASES, "total")} for name, r in runs.items()}
    return {"trace": kind, "length": length, "page_size": page_size, "requests": len(trace),
            "hit_rate": hits["SGLang"] / sum(len(p) for p, _ in trace), "us": per_req,
            "ratio": per_req["kvbackend"]["total"] / per_req["SGLang"]["total"]}


def print_tables(results: list[dict]) -> None:
    print("| trace | page | prompt tokens | hit rate | SGLang µs/req | kvbackend µs/req "
          "| kvbackend / SGLang |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        us = r["us"]
        print(f"| {r['trace']} | {r['page_size']} | {r['length']:,} | {r['hit_rate']:.2f} | "
              f"{us['SGLang']['total']:,.0f} | {us['kvbackend']['total']:,.0f} | "
              f"{r['ratio']:.2f} |")
    print("\nµs per request and phase, SGLang / kvbackend:\n")
    print("| trace | page | prompt tokens | " + " | ".join(PHASES) + " |\n|---|---:|---:|"
          + "---:|" * len(PHASES))
    for r in results:
        us = r["us"]
        cells = [f"{us['SGLang'][p]:,.0f} / {us['kvbackend'][p]:,.0f}" for p in PHASES]
        print(f"| {r['trace']} | {r['page_size']} | {r['length']:,} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = trace_parser(__doc__, token_budget=1 << 21, max_requests=64)
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--chunk", type=int, default=8192, help="chunked prefill size")
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of CPU time")
    parser.add_argument("--quick", action="store_true", help="1k and 8k tokens, 2 repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.lengths, args.repeats = "1024,8192", 2
    lengths, page_sizes = int_list(args.lengths), int_list(args.page_sizes)
    traces = [t for t in args.traces.split(",") if t.strip()]
    started = time.perf_counter()
    with runtime_context._CONTEXT.override_server_args():  # release_kv_cache reads it
        for ps in page_sizes:  # warm-up: compile (or load) kvbackend's numba kernels
            run_once(KVBackendRadixCache, ps, make_trace("shared", 256, 8, 4,
                                                         np.random.default_rng(0)), args)
        results = [bench(kind, length, ps, args)
                   for kind in traces for ps in page_sizes for length in lengths]
    print_tables(results)
    print(f"\nchunk {args.chunk}, decode {args.decode}, pool ~{POOL_PROMPTS} prompts, "
          f"{'wall' if args.wall else 'CPU'} time, median of {args.repeats}; "
          f"{time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
