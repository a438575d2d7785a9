"""The OpenAI-compatible server with ``--kv-backend kvbackend``, run as a subprocess.

One server start for the whole module (~60-80 s on 2 cores). Requests use
token-id prompts, so hit counts are exact: a 600-token shared prefix must add
exactly 600 to ``vllm:prefix_cache_hits_total`` and to ``cached_tokens``.

The failure-at-start cases run first, all at once, and stop in argument parsing
(no model load): ~15-30 s together, mostly interpreter and vLLM import.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvbackend.testing.ports import free_port

pytest.importorskip("vllm")

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
BLOCK_SIZE = 32  # as in conftest.py
MAX_MODEL_LEN = 2048
STARTUP_TIMEOUT_S = 240
PARSE_TIMEOUT_S = 120
PREFIX_LEN = 600  # not a multiple of BLOCK_SIZE: vLLM's own cache would reuse 576
QUESTION_LEN = 40
VOCAB = (3, 512)  # the tiny Llama's word ids (0-2 are special)
# One KV block of the tiny Llama over all layers: K and V x 2 layers x 2 KV heads x 32 dims
# x BLOCK_SIZE tokens x 4 bytes (float32).
BLOCK_NBYTES = 2 * 2 * 2 * 32 * BLOCK_SIZE * 4
DEVICE_BYTES = 128 * BLOCK_NBYTES
HOST_BYTES = 256 * BLOCK_NBYTES
EXPLAIN_FILE = "misses.jsonl"  # explain_misses, next to the server's log


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}


def _tail(path, n: int = 60) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


# ------------------------------------------------------------ start failures
BAD_STARTS = {
    "not-json": (["--kv-backend", "kvbackend", "--kv-backend-config", "{max_pinned_fraction: 1"],
                 ["argument --kv-backend-config", "is not valid JSON"]),
    "unknown-key": (["--kv-backend", "kvbackend", "--kv-backend-config", '{"max_pinned": 0.1}'],
                    ["argument --kv-backend-config", "unknown configuration key(s) ['max_pinned']",
                     "max_pinned_fraction"]),
    "bad-value": (["--kv-backend", "kvbackend", "--kv-backend-config",
                   '{"max_pinned_fraction": 2}'],
                  ["max_pinned_fraction must be a number in [0, 1], got 2"]),
    "unknown-backend": (["--kv-backend", "foo"],
                        ["argument --kv-backend: invalid choice: 'foo'", "kvbackend"]),
    "config-without-backend": (["--kv-backend-config", "{}"],
                               ["--kv-backend-config needs --kv-backend kvbackend"]),
}


@pytest.fixture(scope="module")
def bad_starts(tiny_model):
    """Start every bad command line at once; return {case: (returncode, stderr, seconds)}."""
    started = {}
    for name, (flags, _) in BAD_STARTS.items():
        cmd = [sys.executable, "-m", SERVER_MODULE, "--model", tiny_model,
               "--port", str(free_port()), *flags]
        started[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, env=_env(),
                                          start_new_session=True), time.monotonic())
    results = {}
    try:
        for name, (proc, t0) in started.items():
            try:
                _, err = proc.communicate(timeout=max(1.0, t0 + PARSE_TIMEOUT_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                _, err = proc.communicate()
                results[name] = (None, err.decode(errors="replace"), PARSE_TIMEOUT_S)
                continue
            results[name] = (proc.returncode, err.decode(errors="replace"), time.monotonic() - t0)
    finally:
        for proc, _ in started.values():
            _kill_group(proc)
    return results


@pytest.mark.parametrize("case", list(BAD_STARTS))
def test_bad_start_exits_with_clear_message(bad_starts, case):
    returncode, stderr, _ = bad_starts[case]
    assert returncode is not None, f"still running after {PARSE_TIMEOUT_S} s:\n{stderr[-3000:]}"
    assert returncode != 0
    for fragment in BAD_STARTS[case][1]:
        assert fragment in stderr, f"{fragment!r} not in stderr:\n{stderr[-3000:]}"
    assert "Application startup complete" not in stderr


# ------------------------------------------------------------------ server
class Server:
    def __init__(self, proc: subprocess.Popen, port: int, model: str, log_path,
                 disk_dir: str | None = None) -> None:
        self.proc, self.model, self.log_path, self.disk_dir = proc, model, log_path, disk_dir
        self.base = f"http://127.0.0.1:{port}"

    def complete(self, prompt: list[int], **extra) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            pytest.fail(f"HTTP {e.code}: {e.read().decode(errors='replace')}")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            return r.read().decode()

    def prefix_metrics(self) -> tuple[float, float]:
        """(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``)."""
        text = self.metrics_text()
        values = {}
        for name in ("queries", "hits"):
            pattern = rf"^vllm:prefix_cache_{name}_total(?:{{[^}}]*}})? (\S+)$"
            found = re.findall(pattern, text, re.M)
            assert found, f"vllm:prefix_cache_{name}_total missing from /metrics"
            values[name] = sum(float(v) for v in found)
        return values["queries"], values["hits"]

    def complete_and_count(self, prompt: list[int], **extra) -> tuple[dict, float]:
        """Send one request; return its response and the hit tokens it added to /metrics.

        Stats reach the frontend with the engine's outputs; wait (bounded) until the
        query counter has grown by this prompt's length before reading the hits.
        """
        queries0, hits0 = self.prefix_metrics()
        response = self.complete(prompt, **extra)
        deadline = time.monotonic() + 10
        while True:
            queries, hits = self.prefix_metrics()
            if queries - queries0 >= len(prompt) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert queries - queries0 == len(prompt), (queries0, queries)
        return response, hits - hits0

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One server for the module: a device cache of DEVICE_BYTES (128 blocks of the tiny
    model), a host tier twice that (so a prefix pushed out of the device can still be on
    host) and a disk tier."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    disk_dir = str(tmp_path_factory.mktemp("disk-cache"))
    backend_config = {"max_pinned_fraction": 0.25, "host_cache_gb": HOST_BYTES / (1 << 30),
                      "disk_cache_dir": disk_dir, "disk_cache_gb": 1,
                      "explain_misses": str(log_path.parent / EXPLAIN_FILE)}
    cmd = [sys.executable, "-m", SERVER_MODULE, "--model", tiny_model,
           "--kv-backend", "kvbackend", "--kv-backend-config", json.dumps(backend_config),
           "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
           "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", str(DEVICE_BYTES),
           "--enable-prompt-tokens-details", "--kv-cache-metrics", "--kv-cache-metrics-sample",
           "1.0", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within {STARTUP_TIMEOUT_S} s:\n{_tail(log_path)}")
            time.sleep(1)
        yield Server(proc, port, tiny_model, log_path, disk_dir)
    finally:
        _kill_group(proc)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def test_shared_prefix_hits_through_openai_api(server):
    rng = random.Random(1234)
    prefix = _tokens(rng, PREFIX_LEN)
    prompts = [prefix + _tokens(rng, QUESTION_LEN) for _ in range(4)]

    def cached(response) -> int:
        details = response["usage"].get("prompt_tokens_details")
        assert details is not None, "--enable-prompt-tokens-details was given"
        return details["cached_tokens"]

    first, hits = server.complete_and_count(prompts[0])
    assert (cached(first), hits) == (0, 0)
    assert first["usage"]["prompt_tokens"] == PREFIX_LEN + QUESTION_LEN
    assert len(first["choices"][0]["text"].split()) == 4

    # Token-exact: the whole 600-token prefix, not the 576 of 18 full blocks.
    second, hits = server.complete_and_count(prompts[1])
    assert (cached(second), hits) == (PREFIX_LEN, PREFIX_LEN)

    # The same prompt again: everything but the last token (which must be recomputed),
    # and the same greedy output as the cold run.
    again, hits = server.complete_and_count(prompts[0])
    full = PREFIX_LEN + QUESTION_LEN - 1
    assert (cached(again), hits) == (full, full)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]

    # Retention hints travel in vllm_xargs; the request is served and hits as usual.
    pinned, hits = server.complete_and_count(
        prompts[2], vllm_xargs={"kv_pin": True, "kv_priority": 3})
    assert (cached(pinned), hits) == (PREFIX_LEN, PREFIX_LEN)

    # A cache salt is a separate namespace: tenant-b starts cold, then shares with itself.
    salted, hits = server.complete_and_count(prompts[3], cache_salt="tenant-b")
    assert (cached(salted), hits) == (0, 0)
    salted2, hits = server.complete_and_count(prompts[1], cache_salt="tenant-b")
    assert (cached(salted2), hits) == (PREFIX_LEN, PREFIX_LEN)

    _, total_hits = server.prefix_metrics()
    assert total_hits >= 3 * PREFIX_LEN + full
    assert "Traceback" not in server.log()


def test_kv_pin_over_http_is_honoured(server):
    prompt = _tokens(random.Random(99), 100)
    response = server.complete(prompt, vllm_xargs={"kv_pin": True})
    assert response["usage"]["prompt_tokens"] == 100
    time.sleep(0.5)  # the engine core's stderr reaches the shared log asynchronously
    log = server.log()
    assert "kv_pin must be a bool" not in log
    assert "would exceed max_pinned_fraction" not in log


def _post_completion(server: Server, body: dict) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a completion request, error responses included."""
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode(errors="replace"))


@pytest.mark.parametrize("xargs,option", [({"kv_priority": "high"}, "kv_priority"),
                                          ({"kv_pin": "maybe"}, "kv_pin"),
                                          ({"kv_pin": 2, "kv_priority": 1}, "kv_pin"),
                                          ({"kv_retain_s": -5}, "kv_retain_s")])
def test_bad_request_options_get_http_400(server, xargs, option):
    body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 2, "vllm_xargs": xargs}
    status, response = _post_completion(server, body)
    assert status == 400, response
    assert option in response["error"]["message"], response
    status, response = _post_completion(server, {**body, "vllm_xargs": {"kv_pin": "true"}})
    assert status == 200, response


# ------------------------------------------------------------------ metrics
def _kvbackend_series(server: Server) -> dict[tuple[str, str], float]:
    """{(series name, tier): value} of every ``kvbackend:`` sample, summed over the
    other labels."""
    values: dict[tuple[str, str], float] = {}
    for name, labels, value in re.findall(r"^(kvbackend:\w+)\{([^}]*)\} (\S+)$",
                                          server.metrics_text(), re.M):
        tier = re.search(r'tier="(\w+)"', labels)
        assert tier is not None, f"{name}{{{labels}}} has no tier label"
        if 'le="' not in labels:
            key = (name.removeprefix("kvbackend:"), tier.group(1))
            values[key] = values.get(key, 0.0) + float(value)
    return values


def _moved(server: Server, before: dict, expected: dict) -> dict[tuple[str, str], float]:
    """The series' change since ``before``, once every ``expected`` series has moved at
    least that far (stats reach the API process a step after the request's output)."""
    deadline = time.monotonic() + 10
    while True:
        now = _kvbackend_series(server)
        delta = {key: now.get(key, 0.0) - before.get(key, 0.0) for key in now}
        if all(delta.get(key, 0) >= n for key, n in expected.items()):
            return delta
        if time.monotonic() > deadline:
            pytest.fail(f"series did not move as expected: {expected} vs {delta}")
        time.sleep(0.1)


def _corrupt_block_files(directory: str) -> int:
    """Flip a byte inside the payload of every block file under ``directory``."""
    count = 0
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            if size > BLOCK_NBYTES:
                with open(path, "r+b") as f:
                    f.seek(size // 2)
                    byte = f.read(1)
                    f.seek(size // 2)
                    f.write(bytes([byte[0] ^ 0xFF]))
                count += 1
    return count


def test_metrics_per_tier(server):
    """Requests built to hit each tier move that tier's ``kvbackend:`` series by the
    exact amount: a device hit, a prefix pushed out of the device but still on host,
    one pushed out of host too (disk), then corrupted disk blocks (verification).
    Device 128 blocks, host 256 (module fixture); a salt keeps other tests' prefixes
    out of the way, and each prompt starts with its own token, so no two share one."""
    salt, rng = "metrics-test", random.Random(2026)
    first_tokens = iter(range(VOCAB[1] - 1, VOCAB[0], -1))  # other tests count up

    def prompt(n: int) -> list[int]:
        return [next(first_tokens)] + _tokens(rng, n - 1)

    def send(tokens: list[int], **extra) -> dict:
        return server.complete_and_count(tokens, cache_salt=salt, **extra)[0]

    def flood(num_prompts: int) -> None:
        for _ in range(num_prompts):  # 32 blocks each
            server.complete(prompt(1024), cache_salt=salt)

    hit = 608  # of a 640-token prompt: 19 blocks (the last token is always computed)
    hit_bytes = hit // BLOCK_SIZE * BLOCK_NBYTES

    def tier_hit(tokens: list[int], tier: str) -> None:
        """Send ``tokens``: all ``hit`` tokens come from ``tier``, in one load step."""
        before = _kvbackend_series(server)
        send(tokens)
        delta = _moved(server, before, {("hit_tokens_total", tier): hit,
                                        ("load_bytes_total", tier): hit_bytes})
        assert delta[("hit_tokens_total", tier)] == hit
        assert delta[("load_bytes_total", tier)] == hit_bytes
        assert delta[("load_seconds_count", tier)] == 1  # one step, one rank
        assert all(delta.get(("hit_tokens_total", other), 0) == 0
                   for other in ("device", "host", "disk") if other != tier)

    start = _kvbackend_series(server)
    send(prompt(64), vllm_xargs={"kv_pin": True})
    delta = _moved(server, start, {("pinned_blocks", "device"): 2})
    assert delta[("pinned_blocks", "device")] == 2

    evicted_twice, corrupted = prompt(640), prompt(640)
    before = _kvbackend_series(server)
    send(evicted_twice)
    delta = _moved(server, before, {("save_bytes_total", "host"): 20 * BLOCK_NBYTES,
                                    ("save_bytes_total", "disk"): 20 * BLOCK_NBYTES})
    assert delta[("save_bytes_total", "host")] == delta[("save_bytes_total", "disk")] \
        == 20 * BLOCK_NBYTES  # 640 prompt tokens: 20 full blocks, all new
    send(corrupted)
    flood(9)  # 288 blocks: both leave the device and the host tier
    on_host = prompt(640)
    send(on_host)

    before = _kvbackend_series(server)
    send(on_host[:hit] + [on_host[hit] % 500 + 4] + _tokens(rng, 31))
    delta = _moved(server, before, {("hit_tokens_total", "device"): hit})
    assert delta[("hit_tokens_total", "device")] == hit
    assert delta.get(("hit_tokens_total", "host"), 0) == 0

    flood(6)  # 192 blocks: on_host leaves the device, not the host tier
    tier_hit(on_host, "host")
    tier_hit(evicted_twice, "disk")

    assert _corrupt_block_files(server.disk_dir) > 0
    before = _kvbackend_series(server)
    response = send(corrupted)  # offered from disk; every read fails its checksum
    assert len(response["choices"][0]["text"].split()) == 4  # recomputed and served
    delta = _moved(server, before, {("verify_failed_blocks_total", "disk"): hit // BLOCK_SIZE})
    assert delta[("verify_failed_blocks_total", "disk")] == hit // BLOCK_SIZE
    assert delta.get(("load_bytes_total", "disk"), 0) == 0

    now = _kvbackend_series(server)
    assert 0 < now[("used_bytes", "host")] <= now[("capacity_bytes", "host")] == HOST_BYTES
    assert 0 < now[("used_bytes", "disk")] <= now[("capacity_bytes", "disk")] == 1 << 30
    assert 0 < now[("used_bytes", "device")] <= now[("capacity_bytes", "device")] <= DEVICE_BYTES
    assert "Traceback" not in server.log()


RESIDENCY = ("kv_block_lifetime_seconds", "kv_block_idle_before_evict_seconds",
             "kv_block_reuse_gap_seconds")


def _residency(server: Server) -> dict[str, float]:
    """The ``_count`` and ``_sum`` of vLLM's block residency histograms, all labels."""
    text, values = server.metrics_text(), {}
    for name in RESIDENCY:
        for part in ("count", "sum"):
            found = re.findall(rf"^vllm:{name}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            assert found, f"vllm:{name}_{part} missing from /metrics"
            values[f"{name}_{part}"] = sum(float(v) for v in found)
    return values


def test_block_residency_metrics_record_evicted_blocks(server):
    """``--kv-cache-metrics`` (every block sampled): a 10-block prefix computed once and hit
    twice, then pushed out of the 128-block device, is reported as evicted blocks with
    their lifetime, idle time and reuse gaps. (These histograms stayed empty: vLLM's own
    block pool, which records them, is not used with kvbackend.)"""
    salt, rng = "residency-test", random.Random(11)
    before = _residency(server)
    prefix = _tokens(rng, 10 * BLOCK_SIZE)
    for _ in range(3):
        server.complete(prefix + _tokens(rng, 8), cache_salt=salt)
    for _ in range(6):  # 192 blocks
        server.complete(_tokens(rng, 1024), cache_salt=salt)
    deadline = time.monotonic() + 10
    while True:  # stats reach the frontend a step after the outputs
        delta = {k: v - before[k] for k, v in _residency(server).items()}
        if delta["kv_block_reuse_gap_seconds_count"] >= 10 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta["kv_block_lifetime_seconds_count"] >= 10
    assert delta["kv_block_idle_before_evict_seconds_count"] == delta[
        "kv_block_lifetime_seconds_count"]  # one of each per evicted block
    assert delta["kv_block_reuse_gap_seconds_count"] >= 10  # each prefix block: 2 reads
    assert 0 < delta["kv_block_idle_before_evict_seconds_sum"] <= delta[
        "kv_block_lifetime_seconds_sum"]


# ------------------------------------------------------------ explain_misses
def test_explain_misses_names_each_reason_and_position(server, tiny_model, capsys):
    """Requests built to miss for each reason the server can show; each record names it
    at its position. (``evicted`` needs a prefix gone from every tier: with this
    module's disk tier only a prompt shorter than a block, which no tier stores.)
    A salt of its own keeps other tests' prompts out of the way; each independent
    prompt starts with its own token. Records are told apart by prompt length; only
    lines written by this test count."""
    path = server.log_path.parent / EXPLAIN_FILE
    start = path.stat().st_size
    rng, first_tokens, salt = random.Random(4242), iter(range(*VOCAB)), "explain-test"

    def prompt(n: int) -> list[int]:
        return [next(first_tokens)] + _tokens(rng, n - 1)

    def send(tokens: list[int], **extra) -> None:
        server.complete(tokens, **{"cache_salt": salt, **extra})

    def records(length: int) -> list[dict]:
        with open(path) as f:
            f.seek(start)
            return [r for r in map(json.loads, f) if r["prompt_tokens"] == length]

    def lost(record: dict) -> list[tuple[str, int, int]]:
        return [(s["reason"], s["start"], s["end"]) for s in record["lost"]]

    # Block-aligned, so the spans below do not depend on whether base's partial tail
    # block (its output tokens) is still cached: under pressure that block goes first.
    base = prompt(10 * BLOCK_SIZE)
    n = len(base)
    send(base)
    (never,) = records(n)
    assert never["namespace"].startswith("ns-") and salt not in json.dumps(never)
    assert never["reused_tokens"] == 0
    assert lost(never) == [("never_seen", 0, n - 1), ("final_token", n - 1, n)]

    k = 150  # a changed token, like a timestamp in a system prompt
    changed = base[:k] + [base[k] % 500 + 4] + base[k + 1:] + _tokens(rng, 1)
    send(changed)
    (diverged,) = records(n + 1)
    assert diverged["reused"] == {"device": k}
    assert lost(diverged) == [("diverged", k, n), ("final_token", n, n + 1)]
    window = diverged["lost"][0]
    assert window["position"] == k and window["before"] == base[k - 8:k]
    assert window["request"] == changed[k:k + 8] and window["cached"] == base[k:k + 8]

    send(base + [7, 8, 9], cache_salt="explain-other")  # another tenant: nothing shared
    (other,) = records(n + 3)
    assert other["namespace"] not in ("default", never["namespace"])
    assert lost(other) == [("other_namespace", 0, n), ("never_seen", n, n + 2),
                           ("final_token", n + 2, n + 3)]
    assert other["lost"][0]["namespace"] == never["namespace"]

    send(base + _tokens(rng, 4), prompt_logprobs=1)
    (disabled,) = records(n + 4)
    assert lost(disabled) == [("lookup_disabled", 0, n + 4)]

    twins = prompt(306)  # n=2: two requests, usually admitted in one step
    send(twins, n=2, temperature=1.0, seed=1)
    first, second = records(306)
    full = 305 // BLOCK_SIZE * BLOCK_SIZE  # the partial block is being written in that step
    assert lost(first) == [("never_seen", 0, 305), ("final_token", 305, 306)]
    # Admitted a step later (the second child reached the engine after the step began),
    # the second hits all 305 tokens: the first then only appends to that block.
    assert lost(second) in ([("same_step_block", full, 305), ("final_token", 305, 306)],
                            [("final_token", 305, 306)])

    short, document = prompt(20), prompt(307)
    send(short)
    send(document)
    for _ in range(3):  # 141 blocks: more than the device's unpinned ones
        send(prompt(1500))
    send(document)
    send(short)
    _, from_tiers = records(307)
    aligned = 306 // BLOCK_SIZE * BLOCK_SIZE
    assert from_tiers["reused"]["device"] == 0, from_tiers
    tiers = {tier: n for tier, n in from_tiers["reused"].items() if tier != "device"}
    assert set(tiers) <= {"host", "disk"} and sum(tiers.values()) == aligned, from_tiers
    assert lost(from_tiers) == [("block_alignment", aligned, 306), ("final_token", 306, 307)]
    _, evicted = records(20)
    assert lost(evicted) == [("evicted", 0, 19), ("final_token", 19, 20)]
    assert evicted["lost"][0]["tier"] == "device"

    from kvbackend.cli import main
    assert main(["explain", str(path), "--tokenizer", tiny_model]) == 0
    summary = capsys.readouterr().out
    same_step = ["same_step_block"] if len(lost(second)) > 1 else []
    for reason in ("never_seen", "diverged", "other_namespace", "lookup_disabled",
                   *same_step, "block_alignment", "evicted", "final_token"):
        assert reason in summary
    assert f"token {k}: 1 request\n" in summary
    assert "Traceback" not in server.log()
