"""``explain_misses``: the config key and the JSONL writer (no engine: the manager's
calls are driven directly against a real PrefixCache)."""

from __future__ import annotations

import json
import logging
import os
import stat

import numpy as np
import pytest

from kvbackend.core import PrefixCache
from kvbackend.core.miss_diagnosis import Admission
from kvbackend.vllm.config import KVBackendConfig
from kvbackend.vllm.miss_log import MissLog, namespace_id


def test_explain_misses_path_is_checked_at_start(tmp_path):
    path = tmp_path / "misses.jsonl"
    assert KVBackendConfig.from_dict({"explain_misses": str(path)}).explain_misses == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(ValueError, match="explain_misses: cannot append to .*No such file"):
        KVBackendConfig(explain_misses=str(tmp_path / "missing" / "misses.jsonl"))
    with pytest.raises(ValueError, match="explain_misses: cannot append to .*Is a directory"):
        KVBackendConfig(explain_misses=str(tmp_path))
    for bad in ("", 3):
        with pytest.raises(ValueError, match="explain_misses must be a non-empty string"):
            KVBackendConfig(explain_misses=bad)


BS = 4  # block size of the test cache


class Harness:
    """A real PrefixCache with the MissLog calls the vLLM manager makes."""

    def __init__(self, path, num_blocks: int = 64) -> None:
        self.cache = PrefixCache(num_blocks, BS)
        self.log = MissLog(str(path), self.cache)
        self.path = path
        self._ids = iter(range(10**6))

    def serve(self, prompt, namespace=None) -> None:
        """A request computing ``prompt`` from scratch and publishing it."""
        tokens = np.asarray(prompt, dtype=np.int64)
        request_id = f"fill-{next(self._ids)}"
        seq = self.cache.open_sequence(self.cache.match([], namespace), len(tokens))
        self.cache.cache(seq, tokens)
        self.log.published(request_id, namespace, tokens)
        self.cache.release(seq)
        self.log.forget(request_id)

    def explain(self, prompt, namespace=None, tier_sources=None, **admission) -> dict:
        """Diagnose one admission of ``prompt`` and return the record it wrote."""
        tokens = np.asarray(prompt, dtype=np.int64)
        request_id = f"req-{next(self._ids)}"
        if "device_hit" not in admission:
            admission["device_hit"] = self.cache.match(tokens[:-1], namespace).num_tokens
        self.log.admitted(request_id, namespace, tokens,
                          Admission(limit=len(tokens) - 1, **admission))
        self.log.write(request_id, lambda n: tier_sources or {})
        self.log.forget(request_id)
        *_, last = self.path.read_text().splitlines()
        record = json.loads(last)
        assert record["request_id"] == request_id
        assert sum(s["tokens"] for s in record["lost"]) == record["lost_tokens"]
        assert record["reused_tokens"] + record["lost_tokens"] == len(prompt)
        return record


def reasons(record) -> list[tuple[str, int, int]]:
    return [(s["reason"], s["start"], s["end"]) for s in record["lost"]]


@pytest.fixture
def harness(tmp_path):
    return Harness(tmp_path / "misses.jsonl")


def test_never_seen_and_final_token(harness):
    record = harness.explain(list(range(10, 30)))
    assert record["reused"] == {"device": 0} and record["namespace"] == "default"
    assert reasons(record) == [("never_seen", 0, 19), ("final_token", 19, 20)]
    harness.serve(list(range(10, 30)))
    record = harness.explain(list(range(10, 30)))
    assert (record["reused_tokens"], reasons(record)) == (19, [("final_token", 19, 20)])


def test_divergence_names_the_position_and_the_tokens_around_it(harness):
    cached = list(range(100, 140))
    harness.serve(cached)
    changed = cached[:23] + [7] + cached[24:]  # e.g. a timestamp in a system prompt
    record = harness.explain(changed)
    assert record["reused_tokens"] == 23
    assert reasons(record) == [("diverged", 23, 39), ("final_token", 39, 40)]
    span = record["lost"][0]
    assert span["position"] == 23
    assert span["before"] == cached[15:23]
    assert span["request"] == changed[23:31] and span["cached"] == cached[23:31]


def test_evicted_prefix_is_told_from_a_never_seen_one(harness):
    shared, doc = list(range(200, 208)), list(range(300, 340))
    harness.serve(shared + doc)
    harness.cache.evict(harness.cache.pool.num_blocks)  # everything unlocked goes
    record = harness.explain(shared + doc)
    assert reasons(record) == [("evicted", 0, 47), ("final_token", 47, 48)]
    assert record["lost"][0]["tier"] == "device"
    # A continuation never published: evicted up to the last remembered block boundary.
    record = harness.explain(shared + doc + list(range(400, 410)))
    assert reasons(record) == [("evicted", 0, 48), ("never_seen", 48, 57),
                               ("final_token", 57, 58)]
    harness.log.cleared()  # a reset forgets: nothing published before counts
    record = harness.explain(shared + doc)
    assert reasons(record)[0] == ("never_seen", 0, 47)


def test_another_namespace_holds_the_prompt(harness):
    prompt = list(range(50, 80))
    harness.serve(prompt, namespace=(None, "tenant-a"))
    record = harness.explain(prompt, namespace=(None, "tenant-b"))
    assert record["namespace"] == namespace_id((None, "tenant-b")) != "default"
    assert "tenant" not in json.dumps(record)  # an opaque id, never the salt
    assert reasons(record) == [("other_namespace", 0, 29), ("final_token", 29, 30)]
    assert record["lost"][0]["namespace"] == namespace_id((None, "tenant-a"))
    harness.serve(list(range(600, 620)))  # the default namespace (None) holds it
    record = harness.explain(list(range(600, 620)) + [1, 2, 3], namespace=(None, "tenant-c"))
    assert reasons(record)[0] == ("other_namespace", 0, 20)
    assert record["lost"][0]["namespace"] == "default"
    # Another namespace sharing less than a block (a BOS token, say) is no news.
    record = harness.explain([50, 1, 2, 3, 4, 5, 6], namespace=(None, "tenant-d"))
    assert reasons(record)[0] == ("never_seen", 0, 6)


def test_cuts_by_the_engine(harness):
    prompt = list(range(60, 90))
    harness.serve(prompt[:22])
    record = harness.explain(prompt, device_hit=20, same_step_cut=True)
    assert reasons(record)[:2] == [("same_step_block", 20, 22), ("never_seen", 22, 29)]
    record = harness.explain(prompt, device_hit=20)
    assert reasons(record)[0] == ("block_alignment", 20, 22)
    record = harness.explain(prompt, device_hit=0, lookup=False)
    assert reasons(record) == [("lookup_disabled", 0, 30)]
    record = harness.explain(prompt, device_hit=0, cacheable=False)
    assert reasons(record) == [("not_cacheable", 0, 30)]


def test_tier_hit_sources_and_the_partial_block_they_cannot_hold(harness):
    prompt = list(range(500, 530))
    harness.serve(prompt)
    harness.cache.evict(harness.cache.pool.num_blocks)
    record = harness.explain(prompt, device_hit=0, tier_hit=28,
                             tier_sources={"host": 16, "disk": 12})
    assert record["reused"] == {"device": 0, "host": 16, "disk": 12}
    assert reasons(record) == [("block_alignment", 28, 29), ("final_token", 29, 30)]
    record = harness.explain(prompt, device_hit=0, tier_hit=28, tier_sources={"host": 1})
    assert record["reused"] == {"device": 0, "tiers": 28}  # sources that don't add up


def test_a_failing_file_is_logged_once_and_never_raises(harness, caplog):
    harness.serve(list(range(10)))
    os.close(harness.log._fd)  # the descriptor goes bad under the log
    with caplog.at_level(logging.ERROR, logger="kvbackend.vllm.miss_log"):
        for _ in range(3):
            harness.log.admitted("r", None, np.arange(10, dtype=np.int64),
                                 Admission(limit=9, device_hit=0))
            harness.log.write("r", lambda n: {})
            harness.log.published("r", None, np.arange(12, dtype=np.int64))
    assert len([r for r in caplog.records if "explain_misses" in r.getMessage()]) == 1


def test_explain_summary_counts_causes_and_skips_malformed_lines(harness, capsys):
    from kvbackend.cli import main

    cached = list(range(100, 140))
    harness.serve(cached)
    harness.explain(cached[:9] + [1] + cached[10:])
    harness.explain(cached[:9] + [2] + cached[10:] + [3])
    with open(harness.path, "a") as f:
        f.write("{not json\n\n")
    assert main(["explain", str(harness.path)]) == 0
    out = capsys.readouterr().out
    assert "2 requests, 81 prompt tokens" in out
    assert "reused 18 (22.2%): device 18" in out
    assert "diverged                 61 tokens (75.3%)  in 2 requests" in out
    assert "token 9: 2 requests" in out and "skipped 1 malformed line(s), first line 3" in out
    assert main(["explain", str(harness.path) + ".missing"]) == 2
