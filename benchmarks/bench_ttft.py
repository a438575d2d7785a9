"""First-token time vs prompt length with kvbackend in vLLM (CPU): where the prefix comes from.

    python benchmarks/bench_ttft.py [--quick] [--lengths 1000,2000,4000,8000] [--json out.json]

For each length, a new document (random token ids) is asked with one output token:
    cold    its first sight (full prefill)
    device  asked again at once (the prefix is on the device)
    host    asked again after other documents pushed it off the device (host tier)
    disk    asked first of a fresh engine on the same disk directory (host tier empty)
One engine with a host and a disk tier serves cold, device and host; a second, started
afterwards, serves disk. Each time is the median of ``--repeats`` documents. Model as in
bench_tiers.py (random Llama, hidden 512, 8 layers, float32, block 128); ``--quick``:
lengths 500-2000, 2 documents each. Prints a markdown table; ``--json`` writes the
times (s) and the cached tokens per source, for benchmarks/report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

from bench_tiers import BLOCK, BYTES_PER_TOKEN, build_model, engine, shutdown

SOURCES = ("cold", "device", "host", "disk")
VOCAB = 4096  # build_model's


def first_token(llm, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens or 0


def measure(model: str, root: str, lengths: list[int], repeats: int) -> dict:
    rng = random.Random(3)
    docs = {n: [[rng.randrange(3, VOCAB) for _ in range(n)] for _ in range(repeats)]
            for n in lengths}
    device_tokens = 2 * max(lengths) + 4 * BLOCK
    filler = [[rng.randrange(3, VOCAB) for _ in range(max(lengths))] for _ in range(3)]
    host_tokens = 1.5 * (sum(lengths) * repeats + len(filler) * max(lengths))
    tiers = dict(host_cache_gb=round(host_tokens * BYTES_PER_TOKEN / 2**30 + 0.05, 2),
                 disk_cache_dir=os.path.join(root, "disk"), disk_cache_gb=8)
    samples = {s: {n: [] for n in lengths} for s in SOURCES}
    llm = engine(model, "kvbackend", device_tokens, **tiers)
    first_token(llm, [1] * (2 * BLOCK + 5))  # warm-up of the hit paths, untimed
    first_token(llm, [1] * (2 * BLOCK + 5))
    for n in lengths:
        for d in docs[n]:
            samples["cold"][n].append(first_token(llm, d))
            samples["device"][n].append(first_token(llm, d))
    for f in filler:  # more than the device holds: every document leaves it for the host tier
        first_token(llm, f)
    for n in lengths:
        for d in docs[n]:
            samples["host"][n].append(first_token(llm, d))
    shutdown(llm)
    llm = engine(model, "kvbackend", device_tokens, **tiers)
    first_token(llm, [2] * (2 * BLOCK + 5))
    for n in lengths:
        for d in docs[n]:
            samples["disk"][n].append(first_token(llm, d))
    shutdown(llm)
    return {"lengths": lengths,
            "seconds": {s: [statistics.median(t for t, _ in samples[s][n]) for n in lengths]
                        for s in SOURCES},
            "cached_tokens": {s: [min(c for _, c in samples[s][n]) for n in lengths]
                              for s in SOURCES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter documents, 2 repeats")
    parser.add_argument("--lengths", help="prompt lengths (default 1000,2000,4000,8000)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    default = "500,1000,2000" if args.quick else "1000,2000,4000,8000"
    lengths = [int(x) for x in (args.lengths or default).split(",")]
    repeats = args.repeats or (2 if args.quick else 3)
    root = tempfile.mkdtemp(prefix="bench-ttft-")
    try:
        result = measure(build_model(root), root, lengths, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| prompt tokens | " + " | ".join(f"{s} (s)" for s in SOURCES) + " |")
    print("|---:|" + "---:|" * len(SOURCES))
    for i, n in enumerate(lengths):
        cells = [f"{result['seconds'][s][i]:.3f} ({result['cached_tokens'][s][i]} cached)"
                 for s in SOURCES]
        print(f"| {n:,} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
