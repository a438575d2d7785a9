"""kvbackend vs vLLM's own prefix caching, three workloads on one screen (``make demo``).

Builds a small random Llama (hidden 256, 4 layers) under ``.cache/demo-model`` (nothing
is downloaded) and runs three engines one after another, device KV cache 3072 tokens:

1. kvbackend with a host tier and a disk tier (under ``.cache/demo-disk``, emptied first);
2. vLLM with its own (block-hashed) prefix caching;
3. a fresh kvbackend engine on the same disk directory: a restarted server.

Workloads: *token-exact reuse* (8 requests share a 1000-token prompt, which ends
inside a 32-token block); *overflow* (6 documents of 1000 tokens, round-robin for 3
rounds: twice what the device holds); *restart* (a 2000-token document computed by
engine 1, asked again as the first request of engine 3; vLLM restarted has nothing,
so its time is a cold prefill). Greedy outputs of all engines are compared. Engine logs
go to ``.cache/demo.log``; the screen gets a progress line per engine and one line of
results per workload.

Usage: ``python -m kvbackend.demo [--model-dir DIR]``
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import time
from typing import Any, TextIO

BLOCK_SIZE = 32  # the smallest block vLLM's CPU attention accepts; it makes the gap visible
MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=512)
BYTES_PER_TOKEN = 2 * 4 * 4 * 64 * 4  # (K, V) * layers * kv heads * head dim * float32
DEVICE_TOKENS = 3072
SHARED_LEN, QUESTIONS = 1000, 8  # 31 full blocks + 8 tokens
DOCS, DOC_LEN, ROUNDS = 6, 1000, 3  # 6000 tokens: twice the device cache
RESTART_LEN = 2000
MAX_TOKENS = 4


class Workloads:
    """The prompts (token ids, seeded): ``shared`` (one prompt + questions), ``docs``
    (round-robin), ``restart`` (one document) and ``warm_up`` (ids no other prompt has)."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, 512) for _ in range(n)]  # 0-2: <unk> <s> </s>

        system = tokens(SHARED_LEN)
        self.shared = [system + tokens(rng.randint(16, 48)) for _ in range(QUESTIONS)]
        self.docs = [tokens(DOC_LEN) for _ in range(DOCS)]
        self.restart = tokens(RESTART_LEN)
        # Two prompts sharing 2 full blocks + 6 tokens: the hit paths' first calls, untimed.
        self.warm_up = [[1] * 70 + [2] * 4, [1] * 70 + [2, 1]]


def start_engine(model: str, mode: dict[str, Any]):
    from vllm import LLM
    return LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True,
               block_size=BLOCK_SIZE, kv_cache_memory_bytes=DEVICE_TOKENS * BYTES_PER_TOKEN,
               seed=0, **mode)


def generate(llm, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list:
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run_workloads(llm, work: Workloads) -> dict[str, Any]:
    """Each workload once; cached tokens, times and outputs."""
    generate(llm, work.warm_up[:1])
    generate(llm, work.warm_up[1:])
    # The first request computes the shared prompt; the others come as one batch.
    shared = generate(llm, work.shared[:1]) + generate(llm, work.shared[1:])

    def one_round() -> list:
        return [generate(llm, [doc])[0] for doc in work.docs]

    rounds = [one_round()]  # computes every document: the hits and the time are rounds 2-3
    t0 = time.perf_counter()
    rounds += [one_round() for _ in range(ROUNDS - 1)]
    overflow_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    restart = generate(llm, [work.restart], max_tokens=1)[0]
    restart_s = time.perf_counter() - t0
    return {"shared": shared, "rounds": rounds, "overflow_s": overflow_s,
            "restart": restart, "restart_s": restart_s}


def first_request(llm, work: Workloads) -> dict[str, Any]:
    """A restarted engine: the restart document is its first request (no warm-up)."""
    t0 = time.perf_counter()
    restart = generate(llm, [work.restart], max_tokens=1)[0]
    return {"restart": restart, "restart_s": time.perf_counter() - t0}


def shared_reuse(result: dict[str, Any]) -> str:
    later = result["shared"][1:]
    mean = sum(o.num_cached_tokens or 0 for o in later) / len(later)
    return f"{mean:.0f} of {SHARED_LEN} ({mean / SHARED_LEN:.1%})"


def hit_rate(result: dict[str, Any]) -> float:
    later = [o for r in result["rounds"][1:] for o in r]
    return sum(o.num_cached_tokens or 0 for o in later) / sum(len(o.prompt_token_ids)
                                                              for o in later)


def outputs(result: dict[str, Any]) -> list[list[int]]:
    outs = [*result["shared"], *(o for r in result["rounds"] for o in r), result["restart"]]
    return [list(o.outputs[0].token_ids) for o in outs]


def report(kvb: dict, apc: dict, restarted: dict, screen: TextIO) -> bool:
    """The three result lines; True if every engine's greedy outputs agree."""
    same = (outputs(kvb) == outputs(apc)
            and restarted["restart"].outputs[0].token_ids == apc["restart"].outputs[0].token_ids)
    from_disk = restarted["restart"].num_cached_tokens or 0
    rows = [
        ("workload", "kvbackend", "vLLM prefix caching"),
        ("token-exact reuse", f"{shared_reuse(kvb)} shared tokens reused",
         f"{shared_reuse(apc)} (whole {BLOCK_SIZE}-token blocks only)"),
        ("overflow, rounds 2-3", f"{hit_rate(kvb):.1%} hits (host tier), {kvb['overflow_s']:.1f} s",
         f"{hit_rate(apc):.1%} hits, {apc['overflow_s']:.1f} s"),
        ("restart, first token",
         f"{restarted['restart_s']:.3f} s, {from_disk} of {RESTART_LEN} tokens from disk",
         f"{apc['restart_s']:.3f} s, cold prefill "
         f"({apc['restart_s'] / restarted['restart_s']:.1f}x slower)"),
    ]
    lines = ["", *(f"{a:<22}{b:<46}{c}" for a, b, c in rows), "",
             f"{QUESTIONS} requests share a {SHARED_LEN}-token prompt; {DOCS} documents of "
             f"{DOC_LEN} tokens, {ROUNDS} round-robin rounds, device KV {DEVICE_TOKENS} tokens;",
             f"a {RESTART_LEN}-token document asked first of a restarted engine. Greedy outputs "
             f"of all engines: {'identical' if same else 'DIFFERENT'}."]
    print("\n".join(lines), file=screen, flush=True)
    return same


def quiet_fds(log_path: str) -> TextIO:
    """Send fds 1 and 2 (this process and the engine processes it starts) to ``log_path``;
    return a stream on the original stdout."""
    screen = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    return screen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=os.path.join(".cache", "demo-model"))
    args = parser.parse_args(argv)
    cache_dir = os.path.dirname(os.path.abspath(args.model_dir))
    disk, log_path = os.path.join(cache_dir, "demo-disk"), os.path.join(cache_dir, "demo.log")
    os.makedirs(cache_dir, exist_ok=True)
    shutil.rmtree(disk, ignore_errors=True)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    screen = quiet_fds(log_path)
    print(f"kvbackend demo: random Llama (hidden 256, 4 layers) in {args.model_dir}, block "
          f"{BLOCK_SIZE}, device KV {DEVICE_TOKENS} tokens; engine logs in {log_path}",
          file=screen, flush=True)
    try:
        import kvbackend.vllm
        from kvbackend.testing.tiny_model import build_tiny_llama

        model = build_tiny_llama(args.model_dir, **MODEL)
        work = Workloads()
        tiers = kvbackend.vllm.engine_kwargs(host_cache_gb=0.2, disk_cache_dir=disk)
        steps = [("kvbackend, host + disk tiers", tiers, run_workloads),
                 ("vLLM, its own prefix caching", {"enable_prefix_caching": True}, run_workloads),
                 ("kvbackend restarted on the same disk directory", tiers, first_request)]
        results = []
        for i, (name, mode, workload) in enumerate(steps, 1):
            print(f"[{i}/3] {name}:", end="", file=screen, flush=True)
            t0 = time.perf_counter()
            llm = start_engine(model, mode)
            started = time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                results.append(workload(llm, work))
                ran = time.perf_counter() - t0
            finally:
                shutdown(llm)
            print(f" started in {started:.0f} s, its requests took {ran:.1f} s",
                  file=screen, flush=True)
    except BaseException:
        print(f"\nthe demo failed; the end of {log_path}:", file=screen)
        with open(log_path, errors="replace") as f:
            screen.write("".join(f.readlines()[-40:]))
        raise SystemExit(1) from None
    if not report(*results, screen):
        raise SystemExit("greedy outputs differ between the engines")


if __name__ == "__main__":
    main()
