"""Write the benchmark report: markdown tables and PNG charts from the benchmarks' outputs.

    python benchmarks/report.py DIR

Reads what ``make bench`` leaves in DIR: each benchmark's printed output (``NAME.txt``),
from which every markdown table is kept, ``bench_ttft.json`` (first-token time per
prefix source), ``bench_tiers.json`` (hit rate per round of the overflow scenario) and
``bench_agents.json`` (hit rate per turn and resumed turns' first-token time per
configuration). Writes ``DIR/report.md`` and the charts ``ttft.png``,
``overflow_hits.png`` and ``agents.png`` next to it; a chart whose input is missing is
left out. Runs nothing itself.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

TTFT_CHART, OVERFLOW_CHART, AGENTS_CHART = "ttft.png", "overflow_hits.png", "agents.png"
SOURCE_LABELS = {"cold": "cold prefill", "device": "device hit", "host": "host tier hit",
                 "disk": "disk tier hit (fresh process)"}


def markdown_tables(text: str) -> list[str]:
    """The runs of consecutive lines that start with ``|``, in order. O(len(text))."""
    tables, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            tables.append("\n".join(current))
            current = []
    return tables


def load_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def ttft_chart(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for source, label in SOURCE_LABELS.items():
        ax.plot(result["lengths"], result["seconds"][source], marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("first-token time (s)")
    ax.set_title("First-token time by where the prefix comes from (vLLM CPU + kvbackend)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def overflow_chart(round_robin: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    rates = round_robin["hit_rate_per_round"]
    rounds = range(1, len(next(iter(rates.values()))) + 1)
    width = 0.38
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (mode, label) in enumerate((("kvbackend", "kvbackend + host tier"),
                                       ("vllm-apc", "vLLM prefix caching"))):
        ax.bar([r + (i - 0.5) * width for r in rounds], [100 * h for h in rates[mode]], width,
               label=label)
    ax.set_xticks(list(rounds))
    ax.set_xlabel("round")
    ax.set_ylabel("prompt tokens from cache (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{round_robin['documents']} documents x {round_robin['doc_tokens']} tokens, "
                 f"round-robin; device KV holds {round_robin['device_tokens']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def agents_chart(agents: dict, path: str) -> None:
    """Hit rate per turn (left) and resumed turns' first-token time (right), per configuration."""
    import matplotlib.pyplot as plt

    summaries, load = agents["summaries"], agents["workload"]
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(summaries)
    for i, (name, s) in enumerate(summaries.items()):
        turns = range(1, len(s["hit_rate_per_turn"]) + 1)
        hits.bar([t + (i - (len(summaries) - 1) / 2) * width for t in turns],
                 [100 * h for h in s["hit_rate_per_turn"]], width, label=name)
    hits.set_xticks(list(turns))
    hits.set_xlabel("turn")
    hits.set_ylabel("prompt tokens from cache (%)")
    hits.set_ylim(0, 105)
    hits.legend(fontsize=8)
    names = list(summaries)
    ttft.bar([i - 0.2 for i in range(len(names))],
             [summaries[n]["ttft_median_s"] for n in names], 0.4, label="median")
    ttft.bar([i + 0.2 for i in range(len(names))],
             [summaries[n]["ttft_p90_s"] for n in names], 0.4, label="p90")
    ttft.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ttft.set_ylabel("first-token time, turns 2+ (s)")
    ttft.legend()
    fig.suptitle(f"{load['agents']} agents x {load['turns']} turns, tool calls "
                 f"{load['tool_steps'][0]}-{load['tool_steps'][1]} steps; device KV holds "
                 f"{load['device_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(directory: str) -> str:
    """Write ``report.md`` (and the charts) into ``directory``; return its path."""
    parts = ["# kvbackend benchmark report", ""]
    ttft = load_json(os.path.join(directory, "bench_ttft.json"))
    if ttft is not None:
        ttft_chart(ttft, os.path.join(directory, TTFT_CHART))
        parts += [f"![first-token time vs prompt length]({TTFT_CHART})", ""]
    tiers = load_json(os.path.join(directory, "bench_tiers.json"))
    if tiers is not None:
        overflow_chart(tiers["round_robin"], os.path.join(directory, OVERFLOW_CHART))
        parts += [f"![hit rate per round, documents overflowing the device]({OVERFLOW_CHART})",
                  ""]
    agents = load_json(os.path.join(directory, "bench_agents.json"))
    if agents is not None:
        agents_chart(agents, os.path.join(directory, AGENTS_CHART))
        parts += [f"![agents resuming after tool calls]({AGENTS_CHART})", ""]
    for path in sorted(glob.glob(os.path.join(directory, "*.txt"))):
        with open(path, errors="replace") as f:
            tables = markdown_tables(f.read())
        if tables:
            name = os.path.splitext(os.path.basename(path))[0]
            parts += [f"## {name} (`benchmarks/{name}.py`)", "", *(t + "\n" for t in tables)]
    out = os.path.join(directory, "report.md")
    with open(out, "w") as f:
        f.write("\n".join(parts).rstrip() + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where make bench left the benchmarks' outputs")
    args = parser.parse_args()
    print(f"wrote {write_report(args.directory)}")


if __name__ == "__main__":
    main()
