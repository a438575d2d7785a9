"""kvbackend's host/disk tiers in vLLM (CPU build), side by side with the baselines.

    python benchmarks/bench_tiers.py [--quick] [--out results.md] [--json results.json]
                                     [--scenarios abc]

(a) restart: first-token time of a long document in a *fresh* engine that finds it
    in the disk tier, vs a cold prefill of an equally long document (vLLM, after
    warm-up). Target >= 10x faster.
(b) round-robin over documents that do not fit in the device KV cache: hit rate in
    rounds 2-3 and wall time of kvbackend with a host tier vs vLLM's own prefix
    caching. Targets >= 95% hits, <= 0.4x wall time.
(c) tier load bandwidth: host get + scatter and disk get (read + checksum) + scatter
    of whole blocks (all layers), through the connector's ``BlockMover`` (what the
    workers run), vs a plain memcpy of the same bytes.

Model: random Llama, hidden 512, 8 layers, 8 heads of 64 (no GQA), float32, block 128.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import tempfile
import time

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 512, 8, 8, 8, 64
BLOCK = 128
BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # K and V, float32


def build_model(root: str) -> str:
    from kvbackend.testing.tiny_model import build_tiny_llama
    return build_tiny_llama(os.path.join(root, "llama-512x8"), hidden_size=HIDDEN,
                            num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                            intermediate_size=4 * HIDDEN, vocab_size=4096,
                            max_position_embeddings=16384)


def engine_args(model: str, mode: str, kv_tokens: int, kv_transfer_config=None,
                **tiers) -> dict:
    """``vllm.LLM``'s keyword arguments: ``mode`` "kvbackend" (with ``tiers``), "vllm-apc"
    or "no-cache"; ``kv_transfer_config`` another KV connector."""
    from kvbackend.vllm import engine_kwargs
    kwargs = dict(model=model, dtype="float32", max_model_len=min(8192, kv_tokens - 2 * BLOCK),
                  enforce_eager=True,
                  block_size=BLOCK, kv_cache_memory_bytes=kv_tokens * BYTES_PER_TOKEN, seed=0)
    if mode == "kvbackend":
        kwargs.update(engine_kwargs(kv_transfer_config, **tiers))
    else:
        kwargs["enable_prefix_caching"] = mode == "vllm-apc"
        if kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = kv_transfer_config
    return kwargs


def engine(model: str, mode: str, kv_tokens: int, **tiers):
    import vllm
    return vllm.LLM(**engine_args(model, mode, kv_tokens, **tiers))


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, prompt: list[int], max_tokens: int):
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def timed(llm, prompt, max_tokens=1):
    t = time.perf_counter()
    out = generate(llm, prompt, max_tokens)
    return time.perf_counter() - t, out


def doc(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 4096) for _ in range(n)]


def bench_restart(model: str, root: str, doc_len: int, rows: list) -> None:
    rng = random.Random(1)
    document, other, warm = doc(rng, doc_len), doc(rng, doc_len), doc(rng, 64)
    disk = os.path.join(root, "disk")
    tiers = dict(disk_cache_dir=disk, disk_cache_gb=8)
    llm = engine(model, "kvbackend", 8448, **tiers)  # engine 1 computes and saves
    generate(llm, warm, 1)
    generate(llm, document, 1)
    shutdown(llm)
    llm = engine(model, "kvbackend", 8448, **tiers)  # engine 2: a fresh process
    generate(llm, warm, 1)
    t_hit, out = timed(llm, document)
    shutdown(llm)
    llm = engine(model, "no-cache", 8448)
    generate(llm, warm, 1)
    t_cold, cold_out = timed(llm, other)
    _, check = timed(llm, document)
    shutdown(llm)
    assert out.outputs[0].token_ids == check.outputs[0].token_ids, "restart output differs"
    rows.append((f"(a) restart, {doc_len}-token document: first token (s)",
                 f"{t_hit:.3f} (cached {out.num_cached_tokens} tok)",
                 f"{t_cold:.3f} (cold prefill)",
                 f"{t_cold / t_hit:.1f}x faster", ">= 10x"))


def bench_round_robin(model: str, num_docs: int, doc_len: int, kv_tokens: int,
                      rows: list) -> dict:
    rng = random.Random(2)
    docs = [doc(rng, doc_len) for _ in range(num_docs)]
    host_gb = max(0.25, 1.5 * num_docs * doc_len * BYTES_PER_TOKEN / 2**30)
    results = {}
    for mode, tiers in (("kvbackend", dict(host_cache_gb=round(host_gb, 3))), ("vllm-apc", {})):
        llm = engine(model, mode, kv_tokens, **tiers)
        generate(llm, doc(rng, 64), 1)  # warm-up
        outs, t = [], time.perf_counter()
        for _ in range(3):
            for d in docs:
                outs.append(generate(llm, d, 8))
        wall = time.perf_counter() - t
        shutdown(llm)
        per_round = [hit_rate(outs[r * num_docs:(r + 1) * num_docs]) for r in range(3)]
        results[mode] = (wall, hit_rate(outs[num_docs:]), [o.outputs[0].token_ids for o in outs],
                         per_round)
    (w_ours, h_ours, o_ours, _), (w_apc, h_apc, o_apc, _) = (results["kvbackend"],
                                                               results["vllm-apc"])
    assert o_ours == o_apc, "round-robin outputs differ"
    label = f"(b) {num_docs} docs x {doc_len} tok, device KV {kv_tokens} tok, 3 rounds"
    rows.append((f"{label}: hit rate rounds 2-3", f"{h_ours:.1%}", f"{h_apc:.1%} (vLLM APC)",
                 "", ">= 95%"))
    rows.append((f"{label}: wall time (s)", f"{w_ours:.1f} (host tier {host_gb:.2f} GiB)",
                 f"{w_apc:.1f} (vLLM APC)", f"{w_ours / w_apc:.2f}x", "<= 0.4x"))
    return {"documents": num_docs, "doc_tokens": doc_len, "device_tokens": kv_tokens,
            "hit_rate_per_round": {mode: r[3] for mode, r in results.items()},
            "wall_s": {mode: r[0] for mode, r in results.items()}}


def hit_rate(outputs) -> float:
    """Cached prompt tokens / prompt tokens over ``outputs``."""
    return (sum(o.num_cached_tokens for o in outputs)
            / sum(len(o.prompt_token_ids) for o in outputs))


def bench_bandwidth(root: str, num_blocks: int, rows: list) -> None:
    import torch

    from kvbackend.store import CacheIdentity, DiskTier, HostTier
    from kvbackend.store.block_key import compute_block_keys
    from kvbackend.ops import BlockMover

    total_blocks = num_blocks + 8
    layers = [torch.randn(2, total_blocks, KV_HEADS, BLOCK, HEAD_DIM) for _ in range(LAYERS)]
    ids = list(range(1, num_blocks + 1))
    block_nbytes = BLOCK * BYTES_PER_TOKEN
    nbytes = num_blocks * block_nbytes
    identity = CacheIdentity("0" * 64, "float32", BLOCK, "bench")
    keys = compute_block_keys(list(range(num_blocks * BLOCK)), BLOCK, identity.digest())
    host = HostTier(2 * nbytes)
    disk = DiskTier(os.path.join(root, "bw"), 4 * nbytes, identity, durable=False)
    saver = BlockMover(layers, 1, block_nbytes, BLOCK, host, disk)
    saver.save_many([(block_id, key, True, True, False) for block_id, key in zip(ids, keys)])
    # What the connector's workers run: host / disk get (+ verify) + scatter, per block.
    movers = {"host": BlockMover(layers, 1, block_nbytes, BLOCK, host, None),
              "disk": BlockMover(layers, 1, block_nbytes, BLOCK, None, disk)}

    loads = [(block_id, key, False, False) for block_id, key in zip(ids, keys)]

    def load(mover: BlockMover) -> float:
        t = time.perf_counter()
        assert all(mover.load_many(loads))
        return time.perf_counter() - t

    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)

    def memcpy() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t

    best = {name: min(fn() for _ in range(5)) for name, fn in
            (("host", lambda: load(movers["host"])), ("disk", lambda: load(movers["disk"])),
             ("memcpy", memcpy))}
    gb = nbytes / 1e9
    for name in ("host", "disk"):
        rows.append((f"(c) {name} tier load: get + scatter of {num_blocks} blocks "
                     f"({block_nbytes / 2**20:.0f} MiB each, all layers), GB/s",
                     f"{gb / best[name]:.2f}", f"{gb / best['memcpy']:.2f} (memcpy)",
                     f"{best['memcpy'] / best[name]:.2f}x of memcpy", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller documents (a smoke run)")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the round-robin's hit rate per round (for report.py)")
    parser.add_argument("--scenarios", default="abc", help="which of (a), (b), (c) to run")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-tiers-")
    try:
        model = build_model(root)
        rows: list = []
        round_robin = None
        if "a" in args.scenarios:
            bench_restart(model, root, 2000 if args.quick else 6000, rows)
        if "b" in args.scenarios:
            round_robin = (bench_round_robin(model, 4, 1000, 3072, rows) if args.quick
                           else bench_round_robin(model, 6, 3000, 10240, rows))
        if "c" in args.scenarios:
            bench_bandwidth(root, 8 if args.quick else 32, rows)
        lines = ["| scenario | kvbackend tiers | baseline | ratio | target |",
                 "|---|---|---|---|---|"] + ["| " + " | ".join(r) + " |" for r in rows]
        table = "\n".join(lines)
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table + "\n")
        if args.json and round_robin is not None:
            with open(args.json, "w") as f:
                json.dump({"round_robin": round_robin}, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
