"""Bandwidth of gather/scatter/copy_blocks: C++ extension vs pure-torch fallback vs memcpy.

The cache is vLLM-CPU-like: ``num_layers`` x ``[2, num_blocks, heads, block_size, head_size]``
(block_dim 1). Each op moves ``num_ids`` whole blocks of every layer; the baseline is
one ``dst.copy_(src)`` of the same number of bytes. GB/s counts bytes copied (1e9 bytes).
Prints a markdown table.

    python benchmarks/bench_block_copy.py [--device cuda] [--num-ids 32] ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from kvbackend.ops import _extension, block_layout, copy_blocks, extension_available
from kvbackend.ops import gather_blocks, scatter_blocks


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up (and first-use build)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--num-ids", type=int, default=32, help="blocks moved per call")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    device = torch.device(args.device)
    shape = (2, args.num_blocks, args.heads, args.block_size, args.head_size)
    layers = [torch.randn(shape, device=device) for _ in range(args.num_layers)]
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(args.num_blocks, generator=gen)
    ids = perm[:args.num_ids]
    src, dst = perm[:args.num_ids // 2], perm[args.num_ids // 2:args.num_ids]
    nbytes = args.num_ids * block_layout(layers, 1).block_nbytes
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    plain_src = torch.empty_like(buffer)

    backends = ["extension", "torch"] if extension_available() else ["torch"]
    rows = [("memcpy (dst.copy_(src))", "torch", nbytes,
             _median_seconds(lambda: buffer.copy_(plain_src), device, args.repeats))]
    for backend in backends:
        os.environ[_extension.DISABLE_ENV] = "1" if backend == "torch" else "0"
        ops = [
            ("gather_blocks", nbytes, lambda: gather_blocks(layers, ids, buffer, block_dim=1)),
            ("scatter_blocks", nbytes, lambda: scatter_blocks(buffer, layers, ids, block_dim=1)),
            ("copy_blocks", nbytes // 2, lambda: copy_blocks(layers, src, dst, block_dim=1)),
        ]
        for name, moved, fn in ops:
            rows.append((name, backend, moved, _median_seconds(fn, device, args.repeats)))
    os.environ.pop(_extension.DISABLE_ENV)

    print(f"{args.num_layers} layers x {list(shape)} float32 on {device}, {args.num_ids} blocks "
          f"per call, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| op | backend | MiB moved | ms (median) | GB/s |")
    print("|---|---|---:|---:|---:|")
    for name, backend, moved, seconds in rows:
        print(f"| {name} | {backend} | {moved / 2**20:.0f} | {seconds * 1e3:.2f} "
              f"| {moved / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
