"""Agents with tool calls on vLLM (CPU): does a conversation's KV survive its tool call?

    python benchmarks/bench_agents.py [--agents 8] [--turns 4] [--json out.json] ...

With all defaults it takes about 8 minutes on a shared 2-core machine, five engine
start-ups included.

The workload (token ids, seeded): ``--agents`` agents share a system prompt with tool
definitions (``--system-tokens``); each has its own task (``--task-tokens``) and runs
``--turns`` turns. A turn is one greedy request of ``--output-tokens`` tokens on the whole
conversation so far; then a tool call "runs" for a random number of engine steps
(``--tool-steps``, uniform) while the other agents keep the engine busy, and its result
(``--tool-tokens``) is appended for the next turn. Agent i starts at step
i * ``--start-gap``. Meanwhile one-shot chat requests (``--chat-tokens`` unique tokens,
no hint) arrive every ``--chat-every`` steps: the ordinary traffic an LRU cache keeps in
place of a waiting agent's context. The device KV cache (``--device-tokens``) holds the
system prompt and a few conversations, fewer than there are agents, so the cache must
choose.

The clock is the engine step: the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the benchmark calls ``LLMEngine.step()``, so
which request arrives when does not depend on the machine's speed. When no request is
left to run, the clock jumps to the next arrival.

Configurations (``--configs``), each in a fresh process, one after another:

    vllm-apc               vLLM's own prefix caching (block-granular, LRU)
    kvbackend              kvbackend, no hints (token-exact, LRU by priority)
    kvbackend+retain       each turn that ends in a tool call asks ``kv_retain_s`` for
                           about the tool's run time (see ``--retain-margin``)
    kvbackend+host         kvbackend with a host tier (``--host-gb``) for evicted blocks
    kvbackend+host+retain  both

``kv_retain_s`` is in seconds and the clock in steps: a turn asks for its tool's steps
times the mean wall time of an engine step so far, times ``--retain-margin``.

Reported per configuration: first-token time (submission to the step that returned the
first token, wall seconds) of turns 2+ (median, p90); prompt tokens computed (prompt -
``num_cached_tokens``, exact); hit rate per turn (cached / prompt tokens); context reuse
of turns 2+ (cached tokens / the previous turn's prompt + output: what a resumed agent
finds of its conversation); total wall time; ratios against vLLM's prefix caching. The
greedy outputs of every configuration must be identical (the benchmark exits 1
otherwise). Model and engine as in bench_tiers.py (random Llama, hidden 512, 8 layers,
float32, block 128). ``--json`` writes the results for benchmarks/report.py.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_tiers import BYTES_PER_TOKEN, build_model, engine, shutdown

VOCAB = 4096  # build_model's
FIRST_WORD_ID = 3  # ids 0-2 are <unk> <s> </s>
CONFIGS = {  # name: (engine mode, host tier?, kv_retain_s?)
    "vllm-apc": ("vllm-apc", False, False),
    "kvbackend": ("kvbackend", False, False),
    "kvbackend+retain": ("kvbackend", False, True),
    "kvbackend+host": ("kvbackend", True, False),
    "kvbackend+host+retain": ("kvbackend", True, True),
}


class Agent:
    """One agent's script: its task, and per turn the tool's run time (steps) and result."""

    def __init__(self, rng: random.Random, args) -> None:
        self.task = words(rng, args.task_tokens)
        low, high = args.tool_steps
        self.tool_steps = [rng.randint(low, high) for _ in range(args.turns - 1)]
        self.tool_results = [words(rng, args.tool_tokens) for _ in range(args.turns - 1)]


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_WORD_ID, VOCAB) for _ in range(n)]


def workload(args) -> tuple[list[int], list[Agent]]:
    rng = random.Random(args.seed)
    return words(rng, args.system_tokens), [Agent(rng, args) for _ in range(args.agents)]


class AgentLoop:
    """Drives an engine step by step through every agent's turns, with chat traffic.

    ``clock`` is the simulated time in engine steps (it jumps over stretches where the
    engine has nothing to run); ``due`` holds (clock, kind, index): an agent's next turn
    ("turn", agent) or the next one-shot chat request ("chat", number), every
    ``--chat-every`` steps while any agent has turns left. Each request leaves a record
    under its request id: prompt tokens, cached tokens, output, first-token time (s),
    and for a turn its agent and turn number.
    """

    def __init__(self, engine_core, system: list[int], agents: list[Agent], args,
                 retain: bool) -> None:
        self.core, self.agents, self.args, self.retain = engine_core, agents, args, retain
        self.due = [(i * args.start_gap, "turn", i) for i in range(len(agents))]
        if args.chat_every:
            self.due.append((0, "chat", 0))
        heapq.heapify(self.due)
        self.context = [system + a.task for a in agents]
        self.turn = [0] * len(agents)
        self.turns_left = len(agents) * args.turns
        self.chat_rng = random.Random(args.seed + 1)
        self.live: dict[str, dict] = {}
        self.records: dict[str, dict] = {}
        self.clock = self.engine_steps = 0
        self.start = time.perf_counter()

    def run(self) -> dict[str, dict]:
        """Until every agent ran its turns. O(steps + requests log agents)."""
        while self.turns_left or self.live:
            while self.turns_left and self.due and self.due[0][0] <= self.clock:
                _, kind, i = heapq.heappop(self.due)
                if kind == "turn":
                    self.submit(f"agent{i}-turn{self.turn[i]}", self.context[i], self.params(i),
                                agent=i, turn=self.turn[i])
                else:
                    self.submit(f"chat{i}", words(self.chat_rng, self.args.chat_tokens),
                                self.params(None))
                    heapq.heappush(self.due, (self.clock + self.args.chat_every, "chat", i + 1))
            if self.live:
                self.step()
            elif self.turns_left:
                self.clock = self.due[0][0]  # nothing to run until then
        return self.records

    def submit(self, rid: str, prompt: list[int], params, **record) -> None:
        self.live[rid] = {**record, "prompt_tokens": len(prompt), "submit_s": time.perf_counter()}
        self.core.add_request(rid, {"prompt_token_ids": list(prompt)}, params)

    def params(self, i: int | None):
        """Greedy; with ``retain``, agent ``i``'s turn that ends in a tool call asks
        ``kv_retain_s`` = the tool's steps x the mean wall time of a step so far x
        ``--retain-margin`` (chats, ``i`` None, ask nothing)."""
        from vllm import SamplingParams

        extra = None
        if self.retain and i is not None and self.turn[i] < self.args.turns - 1:
            step_s = (time.perf_counter() - self.start) / max(self.engine_steps, 1)
            tool_s = self.agents[i].tool_steps[self.turn[i]] * step_s
            extra = {"kv_retain_s": tool_s * self.args.retain_margin}
        return SamplingParams(temperature=0, max_tokens=self.args.output_tokens,
                              ignore_eos=True, extra_args=extra)

    def step(self) -> None:
        outputs = self.core.step()
        now = time.perf_counter()
        self.clock += 1
        self.engine_steps += 1
        for out in outputs:
            rec = self.live[out.request_id]
            if "first_token_s" not in rec and out.outputs[0].token_ids:
                rec["first_token_s"] = now - rec["submit_s"]
            if out.finished:
                del self.live[out.request_id]
                rec.update(cached_tokens=out.num_cached_tokens or 0,
                           output=list(out.outputs[0].token_ids))
                self.records[out.request_id] = rec
                if "agent" in rec:
                    self.tool_call(rec["agent"], rec["output"])

    def tool_call(self, i: int, output: list[int]) -> None:
        """Agent ``i``'s turn ended: its tool runs, then the next turn is due."""
        self.turns_left -= 1
        self.turn[i] += 1
        if self.turn[i] < self.args.turns:
            k = self.turn[i] - 1
            self.context[i] += output + self.agents[i].tool_results[k]
            heapq.heappush(self.due, (self.clock + self.agents[i].tool_steps[k], "turn", i))


def run_config(name: str, model: str, args) -> dict:
    """One configuration in this process (a fresh one: see main)."""
    mode, host, retain = CONFIGS[name]
    config = {"host_cache_gb": args.host_gb} if host else {}
    if mode == "kvbackend" and args.max_retained_fraction is not None:
        config["max_retained_fraction"] = args.max_retained_fraction
    if mode == "kvbackend" and args.explain_misses:
        config["explain_misses"] = os.path.join(args.explain_misses, f"{name}.jsonl")
    llm = engine(model, mode, args.device_tokens, **config)
    try:
        system, agents = workload(args)
        # Shares no prefix with the workload (Random(-1) was Random(1): the first chat's).
        warm = words(random.Random("warm-up"), 200)
        llm.generate([{"prompt_token_ids": warm}], use_tqdm=False)
        t = time.perf_counter()
        loop = AgentLoop(llm.llm_engine, system, agents, args, retain)
        records = loop.run()
        wall = time.perf_counter() - t
    finally:
        shutdown(llm)
    return {"wall_s": wall, "steps": loop.engine_steps, "requests": records}


def summarize(result: dict, turns: int) -> dict:
    """Per-turn hit rates, turn-2+ first-token times, prefill and reuse of one configuration."""
    recs = [r for r in result["requests"].values() if "turn" in r]
    by_turn = [[r for r in recs if r["turn"] == t] for t in range(turns)]
    previous = {(r["agent"], r["turn"] + 1): r["prompt_tokens"] + len(r["output"]) for r in recs}
    resumed = [r for r in recs if r["turn"] > 0]
    ttft = sorted(r["first_token_s"] for r in resumed)
    return {
        "hit_rate_per_turn": [sum(r["cached_tokens"] for r in rs)
                              / sum(r["prompt_tokens"] for r in rs) for rs in by_turn],
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": statistics.quantiles(ttft, n=10, method="inclusive")[-1],
        "prefill_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in recs),
        "prefill_tokens_resumed": sum(r["prompt_tokens"] - r["cached_tokens"] for r in resumed),
        "context_reuse": (sum(r["cached_tokens"] for r in resumed)
                          / sum(previous[r["agent"], r["turn"]] for r in resumed)),
        "wall_s": result["wall_s"],
    }


def table(summaries: dict[str, dict]) -> str:
    base = summaries.get("vllm-apc")

    def ratio(name: str, key: str) -> str:
        if base is None or not base[key]:
            return "-"
        return f"{summaries[name][key] / base[key]:.2f}x"

    lines = ["| configuration | turn 2+ first token, median / p90 (s) | p90 vs APC "
             "| prompt tokens computed (turns 2+) | vs APC | context reuse, turns 2+ "
             "| hit rate per turn | wall (s) | vs APC |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, s in summaries.items():
        hits = " / ".join(f"{100 * h:.0f}%" for h in s["hit_rate_per_turn"])
        lines.append(f"| {name} | {s['ttft_median_s']:.3f} / {s['ttft_p90_s']:.3f} "
                     f"| {ratio(name, 'ttft_p90_s')} "
                     f"| {s['prefill_tokens']:,} ({s['prefill_tokens_resumed']:,}) "
                     f"| {ratio(name, 'prefill_tokens')} | {100 * s['context_reuse']:.1f}% "
                     f"| {hits} | {s['wall_s']:.1f} | {ratio(name, 'wall_s')} |")
    return "\n".join(lines)


def mismatches(results: dict[str, dict]) -> list[str]:
    """Requests whose greedy output differs from the first configuration's."""
    names = list(results)
    ref = results[names[0]]["requests"]
    return [f"{name}: {rid}" for name in names[1:]
            for rid, r in results[name]["requests"].items()
            if r["output"] != ref.get(rid, {}).get("output")]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--agents", type=int, default=8)
    add("--turns", type=int, default=4)
    add("--system-tokens", type=int, default=1024, help="shared system prompt + tool definitions")
    add("--task-tokens", type=int, default=128, help="each agent's own task")
    add("--output-tokens", type=int, default=8, help="per turn (greedy, EOS ignored)")
    add("--tool-tokens", type=int, default=128, help="each tool result")
    add("--tool-steps", type=lambda s: tuple(int(x) for x in s.split(",")), default=(16, 48),
        metavar="MIN,MAX", help="a tool call's run time in engine steps (uniform)")
    add("--start-gap", type=int, default=16, help="engine steps between two agents' starts")
    add("--chat-every", type=int, default=8,
        help="engine steps between one-shot chat requests (no hint; 0: none)")
    add("--chat-tokens", type=int, default=256, help="each chat request's (unique) prompt")
    add("--device-tokens", type=int, default=4096, help="device KV cache size in tokens")
    add("--host-gb", type=float, default=0.5, help="host tier size (kvbackend+host)")
    add("--max-retained-fraction", type=float,
        help="kvbackend's bound on retained blocks (None: kvbackend's default)")
    add("--retain-margin", type=float, default=2.0,
        help="kv_retain_s = tool steps x mean step time so far x this")
    add("--explain-misses", metavar="DIR",
        help="kvbackend configurations write explain_misses records to DIR/CONFIG.jsonl")
    add("--configs", default=",".join(CONFIGS), help="comma-separated, run in this order")
    add("--seed", type=int, default=0)
    add("--json", metavar="PATH", help="also write the results as JSON (for report.py)")
    add("--run-config", help=argparse.SUPPRESS)  # internal: one configuration, JSON to stdout
    add("--model", help=argparse.SUPPRESS)
    add("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {list(CONFIGS)}")
    return args


def run_in_fresh_process(name: str, model: str, root: str, argv: list[str]) -> dict:
    """vLLM's in-process worker cannot start once an engine with kvbackend ran in the same
    process (numba's llvmlite is loaded), so each configuration gets its own. Its logs
    go to stderr."""
    result = os.path.join(root, f"{name}.json")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    subprocess.run([sys.executable, __file__, *argv, "--run-config", name, "--model", model,
                    "--result", result], check=True, env=env, stdout=sys.stderr)
    with open(result) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.run_config:
        with open(args.result, "w") as f:
            json.dump(run_config(args.run_config, args.model, args), f)
        return
    names = args.configs.split(",")
    system, agents = workload(args)
    longest = len(system) + args.task_tokens + (args.turns - 1) * (
        args.output_tokens + args.tool_tokens)
    print(f"{args.agents} agents x {args.turns} turns: {args.system_tokens} shared + "
          f"{args.task_tokens} task tokens, +{args.output_tokens} output +{args.tool_tokens} tool "
          f"result per turn (last turn's prompt {longest} tokens); tool calls "
          f"{args.tool_steps[0]}-{args.tool_steps[1]} steps; device KV {args.device_tokens} "
          f"tokens ({args.device_tokens * BYTES_PER_TOKEN / 2**20:.0f} MiB)", flush=True)
    root = tempfile.mkdtemp(prefix="bench-agents-model-")
    results, t0 = {}, time.perf_counter()
    try:
        model = build_model(root)
        for name in names:
            t = time.perf_counter()
            results[name] = run_in_fresh_process(name, model, root, argv)
            r = results[name]
            print(f"  {name}: {r['steps']} steps, {r['wall_s']:.1f} s "
                  f"({time.perf_counter() - t:.0f} s with engine start-up)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summaries = {name: summarize(r, args.turns) for name, r in results.items()}
    print(table(summaries))
    bad = mismatches(results)
    print(f"\nGreedy outputs identical across {', '.join(names)}: {'no' if bad else 'yes'} "
          f"({len(results[names[0]]['requests'])} requests each); "
          f"total {time.perf_counter() - t0:.0f} s")
    for line in bad:
        print(f"  MISMATCH {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": {k: v for k, v in vars(args).items()
                                    if k not in ("run_config", "model", "json")},
                       "summaries": summaries}, f, indent=1)
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
