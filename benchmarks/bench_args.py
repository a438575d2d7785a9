"""Command-line options shared by the trace benchmarks (bench_core.py, bench_sglang.py)."""

from __future__ import annotations

import argparse


def trace_parser(doc: str, *, token_budget: int, max_requests: int) -> argparse.ArgumentParser:
    """A parser with the options every trace benchmark takes; ``doc``'s first paragraph
    is its description."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,8192,32768,131072", help="prompt lengths")
    parser.add_argument("--decode", type=int, default=16, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--token-budget", type=int, default=token_budget, help="tokens per trace")
    parser.add_argument("--max-requests", type=int, default=max_requests)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser


def int_list(text: str) -> list[int]:
    """``"1024,8192"`` -> ``[1024, 8192]``."""
    return [int(x) for x in text.split(",") if x.strip()]
