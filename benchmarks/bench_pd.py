"""Prefill/decode disaggregation over vLLM's NIXL connector (CPU, UCX backend): kvbackend
vs vLLM's own prefix caching, on both instances, side by side in one run.

    python benchmarks/bench_pd.py [--conversations 3] [--turns 4] [--system 1024] [--push]

Conversations share a system prompt; each turn's prompt is the previous turn's prompt, the
decode instance's reply (32 tokens) and a new user message (200 tokens), the turns of all
conversations taken in rounds. A turn is prefilled on the prefill instance (its own
process; one token, its KV held for the decode instance), then decoded on the decode
instance (this process), which pulls the KV its own device cache lacks (``--push``: NIXL's
push mode, where the prefill instance writes it). Per mode: prompt tokens the prefill
instance computed (not hit in its cache), its prefill time, the bytes the decode instance
received, the prompt tokens it hit on its device, and its time (transfer and decode).
Greedy replies must be the same in both modes. Model as in bench_tiers.py (random Llama,
hidden 512, 8 layers, float32, block 128). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from bench_tiers import build_model, doc, engine_args, shutdown

NIXL = {"kv_role": "kv_both"}  # and the connector: NIXL's pull or push mode
KV_TOKENS = 8192 + 256  # each instance's device cache: every conversation fits
REPLY_TOKENS, USER_TOKENS = 32, 200


def metric_sum(llm, name: str, **labels) -> float:
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()):
            total += m.sum if hasattr(m, "sum") else m.value
    return total


def run(model: str, mode: str, conversations: list[list[list[int]]], nixl: dict) -> dict:
    """Serve every turn of ``conversations`` (their user messages; the first holds the
    system prompt too) through a prefill process and a decode engine in ``mode``, both
    running the NIXL connector ``nixl``."""
    import vllm

    from kvbackend.testing.prefill_peer import (
        PrefillPeer, decode_prefilled, moved_bytes, nixl_engine,
    )

    args = engine_args(model, mode, KV_TOKENS, kv_transfer_config=nixl)
    prefill = PrefillPeer({**args, "disable_log_stats": False})
    with nixl_engine():
        decode = vllm.LLM(**args, disable_log_stats=False)

    warm_up = [1] * (2 * 128 + 5)  # NIXL's handshakes and the hit paths, untimed
    decode_prefilled(decode, prefill.ask(warm_up, True), warm_up,
                     vllm.SamplingParams(max_tokens=1))
    baseline = {"moved": moved_bytes(prefill, decode),
                "hits": metric_sum(decode, "vllm:prompt_tokens_cached_by_source",
                                   source="device")}
    totals = dict(prefill_tokens=0, prefill_s=0.0, decode_s=0.0)
    replies, prompts = [], [[] for _ in conversations]
    params = vllm.SamplingParams(temperature=0, max_tokens=REPLY_TOKENS, ignore_eos=True)
    for turn in range(len(conversations[0])):
        for c, messages in enumerate(conversations):
            prompts[c] = prompts[c] + messages[turn]
            prefilled = prefill.ask(prompts[c], remote_decode=True)
            totals["prefill_tokens"] += len(prompts[c]) - prefilled["cached"]
            totals["prefill_s"] += prefilled["seconds"]
            start = time.perf_counter()
            out = decode_prefilled(decode, prefilled, prompts[c], params)
            totals["decode_s"] += time.perf_counter() - start
            replies.append(list(out.outputs[0].token_ids))
            prompts[c] = prompts[c] + replies[-1]
    totals["moved_mib"] = (moved_bytes(prefill, decode) - baseline["moved"]) / 2**20
    totals["decode_hits"] = metric_sum(decode, "vllm:prompt_tokens_cached_by_source",
                                       source="device") - baseline["hits"]
    totals["replies"] = replies
    prefill.close()
    shutdown(decode)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    parser.add_argument("--push", action="store_true",
                        help="NIXL's push mode (NixlPushConnector) instead of pull")
    args = parser.parse_args()
    rng = random.Random(5)
    system = doc(rng, args.system)
    conversations = [[(system if t == 0 else []) + doc(rng, USER_TOKENS)
                      for t in range(args.turns)] for _ in range(args.conversations)]
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as root:  # the model's files
        model = build_model(root)
        nixl = {**NIXL, "kv_connector": "NixlPushConnector" if args.push else "NixlConnector"}
        results = {mode: run(model, mode, conversations, nixl)
                   for mode in ("kvbackend", "vllm-apc")}
    if results["kvbackend"]["replies"] != results["vllm-apc"]["replies"]:
        raise SystemExit("greedy replies differ between kvbackend and vLLM's prefix caching")
    print(f"{nixl['kv_connector']}: {args.conversations} conversations x {args.turns} turns, "
          f"system prompt {args.system} tokens, user messages {USER_TOKENS}, replies "
          f"{REPLY_TOKENS}; replies identical in both modes\n")
    columns = [("prefill_tokens", "prefill: tokens computed", "{:.0f}"),
               ("prefill_s", "prefill: s", "{:.2f}"),
               ("moved_mib", "decode: MiB received", "{:.1f}"),
               ("decode_hits", "decode: device-hit tokens", "{:.0f}"),
               ("decode_s", "decode: s (transfer + 32 tokens)", "{:.2f}")]
    print("| mode | " + " | ".join(title for _, title, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for mode, r in results.items():
        print(f"| {mode} | " + " | ".join(f.format(r[k]) for k, _, f in columns) + " |")
    base = results["vllm-apc"]
    print("| kvbackend / vllm-apc | " + " | ".join(
        f"{results['kvbackend'][k] / base[k]:.2f}x" if base[k] else "-"
        for k, _, _ in columns) + " |")


if __name__ == "__main__":
    main()
