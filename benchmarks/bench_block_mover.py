"""Bandwidth of BlockMover (tier loads and saves) against one plain copy of the same bytes.

The cache is vLLM-like: ``num_layers`` x ``[2, num_blocks, heads, block_size, head_size]``
bf16 (block_dim 1) on ``--device``. Each row moves ``--num-ids`` whole blocks (every
layer) between the cache and the host/disk tiers the way a worker does:

* load host: ``load_many`` of blocks the host tier holds (on a GPU: a pinned row copied
  into one device staging block, then scattered, per block);
* load disk: ``load_many`` of blocks only the disk tier holds (read, BLAKE3-verified,
  scattered; the files are in the page cache after the first repeat);
* save host: ``save_many`` of the blocks into the host tier (gathered, copied out).

The baseline is one ``copy_`` of all the bytes between host memory (pinned on a GPU)
and the cache's device: what a tier could reach if it moved every block in one call.
GB/s counts the bytes of the blocks moved (1e9 bytes). Prints a markdown table.

    python benchmarks/bench_block_mover.py [--device cuda] [--num-ids 64] ...
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from pathlib import Path

import torch
from bench_block_copy import _median_seconds

from kvbackend.ops import BlockMover, block_layout, extension_available
from kvbackend.store import DiskTier, HostTier
from kvbackend.store.identity import CacheIdentity


def _key(i: int) -> str:
    return hashlib.sha256(f"bench-block-{i}".encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--num-ids", type=int, default=64, help="blocks moved per call")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    device = torch.device(args.device)
    shape = (2, 2 * args.num_ids, args.heads, args.block_size, args.head_size)
    layers = [torch.randn(shape, device=device).to(torch.bfloat16)
              for _ in range(args.num_layers)]
    block_nbytes = block_layout(layers, 1).block_nbytes
    nbytes = args.num_ids * block_nbytes
    keys = [_key(i) for i in range(args.num_ids)]
    host = HostTier(2 * nbytes)
    pinned = device.type == "cuda"
    plain_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    plain_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    with tempfile.TemporaryDirectory() as tmp:
        identity = CacheIdentity(model_fingerprint="be" * 32, kv_dtype="bfloat16",
                                 block_size=args.block_size, kv_layout="layer_first",
                                 tp_rank=0, tp_size=1)
        disk = DiskTier(Path(tmp) / "disk", 2 * nbytes, identity, durable=False)
        mover = BlockMover(layers, 1, block_nbytes, args.block_size, host, disk)
        disk_only = BlockMover(layers, 1, block_nbytes, args.block_size, None, disk)
        # blocks 0..n-1 are the sources; loads go to n..2n-1
        mover.save_many([(i, key, True, True, False) for i, key in enumerate(keys)])
        loads = [(args.num_ids + i, key, False, False) for i, key in enumerate(keys)]

        def load_host() -> None:
            assert all(mover.load_many(loads))

        def load_disk() -> None:
            assert all(disk_only.load_many(loads))

        def save_host() -> None:
            mover.save_many([(i, key, True, False, False) for i, key in enumerate(keys)])

        rows = [
            ("one copy_, host -> cache device", _median_seconds(
                lambda: plain_device.copy_(plain_host), device, args.repeats)),
            ("one copy_, cache device -> host", _median_seconds(
                lambda: plain_host.copy_(plain_device), device, args.repeats)),
            ("BlockMover load host", _median_seconds(load_host, device, args.repeats)),
            ("BlockMover load disk", _median_seconds(load_disk, device, args.repeats)),
            ("BlockMover save host", _median_seconds(save_host, device, args.repeats)),
        ]
        host_bytes, pinned_bytes = host.bytes_used, mover.pinned_nbytes
        for i in range(args.num_ids):  # the loads wrote exactly the source blocks' bytes
            for layer in layers:
                assert torch.equal(layer[:, args.num_ids + i], layer[:, i])

    print(f"{args.num_layers} layers x {list(shape)} bf16 on {device}, {args.num_ids} blocks "
          f"of {block_nbytes / 2**20:.2f} MiB per call, pinned host rows: {pinned}, "
          f"extension: {extension_available()}, torch {torch.__version__}")
    print(f"host tier: {host_bytes / 2**20:.0f} MiB in {args.num_ids} rows; pinned for the "
          f"mover's rows: {pinned_bytes / 2**20:.0f} MiB\n")
    print("| path | MiB moved | ms (median) | GB/s | vs one copy_ |")
    print("|---|---:|---:|---:|---:|")
    baseline = {"load": rows[0][1], "save": rows[1][1]}
    for name, seconds in rows:
        ratio = baseline["save" if "save" in name or "-> host" in name else "load"] / seconds
        print(f"| {name} | {nbytes / 2**20:.0f} | {seconds * 1e3:.2f} "
              f"| {nbytes / seconds / 1e9:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
