"""bench_remote.py's second-instance row, in a fresh interpreter (no numba loaded before vLLM).

    python benchmarks/remote_second_instance.py REDIS_URL DOC_TOKENS DOCS

A first engine computes DOCS + 1 documents of DOC_TOKENS random tokens (written through to
the server) and exits; a second engine, its device cache cold and no host or disk tier,
asks each of them and, in turn, a never seen document of the same length (one output
token each; the first pair is a warm-up). Prints one JSON line: the median first-token
times (s) of both and the smallest share of a document loaded from the server.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile

from bench_tiers import BLOCK, build_model, engine, shutdown
from bench_ttft import VOCAB, first_token


def main() -> None:
    url, n, docs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(5)
    shared, cold = ([[rng.randrange(3, VOCAB) for _ in range(n)] for _ in range(docs + 1)]
                    for _ in range(2))
    with tempfile.TemporaryDirectory(prefix="kvb-bench-fleet-") as root:
        model, kv_tokens = build_model(root), 2 * n + 4 * BLOCK
        llm = engine(model, "kvbackend", kv_tokens, remote_cache_url=url)
        for doc in shared:
            first_token(llm, doc)
        shutdown(llm)  # its connector sends the saves still queued
        llm = engine(model, "kvbackend", kv_tokens, remote_cache_url=url)
        first_token(llm, shared[0])  # warm-up of both paths, untimed
        first_token(llm, cold[0])
        second, fresh = [], []
        for doc, other in zip(shared[1:], cold[1:]):
            second.append(first_token(llm, doc))
            fresh.append(first_token(llm, other))
        shutdown(llm)
    print(json.dumps({"second_s": statistics.median(t for t, _ in second),
                      "cold_s": statistics.median(t for t, _ in fresh),
                      "reuse": min(cached for _, cached in second) / n}))


if __name__ == "__main__":
    main()
