"""Cost of ``explain_misses``: kvbackend's manager with the miss log off vs on.

What is measured
    ``bench_scheduler.py``'s trace and timing (vLLM 0.32's scheduler call sequence on
    ``KVBackendManager``, no model, no engine; block 16, ``--concurrency`` requests a
    wave, 70% shared prefix, ``--decode`` steps), once with ``explain_misses`` unset and
    once appending to a file (``--file``, default a temp file), alternating. With the
    log on, every admission is diagnosed in ``allocate`` (the tree walked again, the
    prompt's prefix digests computed and looked up) and its JSON line written in
    ``record_prefix_cache_stats`` (counted in ``allocate`` too); every published token
    is digested into the seen set (``allocate``, ``decode``, ``free``). Microseconds
    per request, median of ``--repeats``; a first pass of each (numba compiles) is
    dropped.

Run (from the repository root)
    .venv/bin/python benchmarks/bench_explain.py              # about two minutes
    .venv/bin/python benchmarks/bench_explain.py --quick
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
from functools import partial

from bench_scheduler import (
    BLOCK_SIZE, KVB_PHASES, SHARED_FRACTION, kv_cache_config, make_prompts, run_trace,
)

from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.manager import KVBackendManager


def make_manager(num_blocks: int, max_model_len: int, explain: str | None) -> KVBackendManager:
    return KVBackendManager(
        kv_cache_config=kv_cache_config(num_blocks), max_model_len=max_model_len,
        max_in_flight_tokens=max_model_len, enable_caching=False, log_stats=False,
        scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE, metrics_collector=None,
        watermark=0.0, backend_config=KVBackendConfig(explain_misses=explain))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--file", help="the explain_misses file (default: a temp file)")
    parser.add_argument("--quick", action="store_true", help="1024,8192; 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats = "1024,8192", 2
    logging.getLogger("vllm").setLevel(logging.WARNING)
    path = args.file or os.path.join(tempfile.mkdtemp(prefix="kvb-explain-"), "misses.jsonl")
    print(f"explain_misses off / on, µs per request (block {BLOCK_SIZE}, {args.concurrency} "
          f"requests x {args.waves} waves, {int(SHARED_FRACTION * 100)}% shared prefix, "
          f"{args.decode} decode steps, median of {args.repeats}; file {path})\n")
    print("| prompt tokens | " + " | ".join(f"{p} off / on" for p in KVB_PHASES)
          + " | total off / on | on - off |")
    print("|---:|" + "---:|" * (len(KVB_PHASES) + 2))
    for length in map(int, args.lengths.split(",")):
        prompts = make_prompts(length, args.concurrency * args.waves, seed=length)
        max_model_len = length + args.decode + 2 * BLOCK_SIZE
        num_blocks = len(prompts) * (-(-max_model_len // BLOCK_SIZE)) + 2 * args.concurrency + 16
        runs = {"off": [], "on": []}
        for _ in range(args.repeats + 1):
            for mode in runs:
                make = partial(make_manager, explain=path if mode == "on" else None)
                runs[mode].append(run_trace("kvbackend", prompts, args.concurrency, args.decode,
                                            num_blocks, max_model_len, None, make)["us"])
        us = {mode: {p: statistics.median(r[p] for r in runs[mode][1:])
                     for p in (*KVB_PHASES, "total")} for mode in runs}
        cells = [f"{us['off'][p]:,.0f} / {us['on'][p]:,.0f}" for p in (*KVB_PHASES, "total")]
        print(f"| {length:,} | {' | '.join(cells)} | "
              f"{us['on']['total'] - us['off']['total']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
