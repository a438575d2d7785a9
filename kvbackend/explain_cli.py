"""``kvbackend explain FILE [--tokenizer DIR]``: summarise an ``explain_misses`` file.

For the requests recorded in FILE (one JSON object a line, written by kvbackend's
vLLM manager; see ``kvbackend/vllm/miss_log.py``) it prints the prompt tokens,
the reused ones by tier, the lost ones by cause (most tokens first), and the most
common divergence points with the tokens around them: the request's and the
cached ones, detokenized with ``--tokenizer`` (a local model directory).
A malformed line is skipped and counted. O(records) time, O(divergence points) memory.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field


@dataclass
class Summary:
    """Totals over the records of one file."""

    requests: int = 0
    prompt_tokens: int = 0
    reused: Counter = field(default_factory=Counter)  # tier -> tokens
    lost: Counter = field(default_factory=Counter)  # reason -> tokens
    lost_requests: Counter = field(default_factory=Counter)  # reason -> requests
    divergences: Counter = field(default_factory=Counter)  # position -> requests
    windows: dict = field(default_factory=dict)  # position -> its first window
    malformed: list[int] = field(default_factory=list)  # line numbers

    def add(self, record: dict) -> None:
        self.requests += 1
        self.prompt_tokens += int(record["prompt_tokens"])
        self.reused.update({tier: int(n) for tier, n in record["reused"].items()})
        for reason in {span["reason"] for span in record["lost"]}:
            self.lost_requests[reason] += 1
        for span in record["lost"]:
            self.lost[span["reason"]] += int(span["tokens"])
            if span["reason"] == "diverged":
                self.divergences[span["position"]] += 1
                self.windows.setdefault(span["position"], span)


def summarise(lines: Iterable[str]) -> Summary:
    summary = Summary()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            summary.add(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError):
            summary.malformed.append(number)
    return summary


def render(summary: Summary, top: int, detokenize: Callable[[list[int]], str]) -> Iterator[str]:
    total = summary.prompt_tokens or 1
    reused, lost = sum(summary.reused.values()), sum(summary.lost.values())
    yield f"{summary.requests:,} requests, {summary.prompt_tokens:,} prompt tokens"
    tiers = ", ".join(f"{tier} {n:,}" for tier, n in summary.reused.most_common() if n)
    yield f"reused {reused:,} ({reused / total:.1%})" + (f": {tiers}" if tiers else "")
    yield f"lost   {lost:,} ({lost / total:.1%}), by cause:"
    for reason, tokens in summary.lost.most_common(top):
        yield (f"  {reason:<16} {tokens:>10,} tokens ({tokens / total:5.1%})  "
               f"in {_requests(summary.lost_requests[reason])}")
    if summary.divergences:
        yield "most common divergence points:"
    for position, count in summary.divergences.most_common(top):
        window = summary.windows[position]
        yield f"  token {position:,}: {_requests(count)}"
        yield f"    before   {detokenize(window['before'])}"
        yield f"    request  {detokenize(window['request'])}"
        yield f"    cached   {detokenize(window['cached'])}"
    if summary.malformed:
        yield (f"skipped {len(summary.malformed)} malformed line(s), first line "
               f"{summary.malformed[0]}")


def _requests(count: int) -> str:
    return f"{count:,} request" + ("s" if count != 1 else "")


def token_renderer(tokenizer_dir: str | None) -> Callable[[list[int]], str]:
    """Token ids as text through a local tokenizer, else as the ids themselves."""
    if tokenizer_dir is None:
        return lambda ids: " ".join(map(str, ids))
    from transformers import AutoTokenizer  # lazy: only with --tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return lambda ids: repr(tokenizer.decode(ids))


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.file, encoding="utf-8") as f:
            summary = summarise(f)
    except OSError as e:
        print(f"kvbackend explain: cannot read {args.file}: {e.strerror}")
        return 2
    try:
        detokenize = token_renderer(args.tokenizer)
    except (OSError, ValueError) as e:
        print(f"kvbackend explain: cannot load a tokenizer from {args.tokenizer}: {e}")
        return 2
    for line in render(summary, args.top, detokenize):
        print(line)
    return 0


def add_parser(top: argparse._SubParsersAction) -> None:
    parser = top.add_parser("explain", help="summarise an explain_misses file: why requests "
                                            "missed the cache")
    parser.add_argument("file", help="the explain_misses file (JSON lines)")
    parser.add_argument("--tokenizer", metavar="MODEL_DIR",
                        help="a local model directory whose tokenizer detokenizes the windows")
    parser.add_argument("--top", type=int, default=8, help="causes and divergence points shown")
    parser.set_defaults(run=run)
