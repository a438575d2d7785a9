"""``KVBackendStats`` / ``KVBackendPromMetrics``: how vLLM merges, ships and records them.

Pure Python (no engine): vLLM merges the ranks' stats of one step and the steps of a
log interval with ``aggregate``, sends ``to_dict()`` through its msgpack encoder inside
``SchedulerStats``, and hands it to the Prometheus logger. The real server test
(``tests/vllm/test_server.py::test_metrics_per_tier``) scrapes the series end to end.
"""

from __future__ import annotations

import functools
import os

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine, initialize, invariant, rule,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.v1.metrics.stats import SchedulerStats  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from kvbackend.ops import BlockMover  # noqa: E402
from kvbackend.store import DiskTier, HostTier  # noqa: E402
from kvbackend.vllm.tiers.connector import KVBackendTierConnector  # noqa: E402
from kvbackend.vllm.tiers.messages import LoadOrder, SaveOrder, StepOrders  # noqa: E402
from kvbackend.vllm.tiers.metrics import (  # noqa: E402
    COUNTERS, GAUGES, HISTOGRAMS, TIERS, KVBackendPromMetrics, KVBackendStats,
)
from kvbackend.vllm.tiers.worker import TierWorker  # noqa: E402
from tests.redis_server import server  # noqa: E402, F401 - the module's server
from tests.store_helpers import key_of, make_identity  # noqa: E402


def _rank_stats(source: str, loaded: int, used: int) -> KVBackendStats:
    stats = KVBackendStats()
    stats.count("load_bytes", "host", loaded)
    stats.observe("load_seconds", "host", 0.5)
    stats.set_gauge("used_bytes", "host", source, used)
    return stats


def test_empty_until_something_is_recorded():
    stats = KVBackendStats()
    assert stats.is_empty()
    stats.count("hit_tokens", "device", 0)  # a zero adds nothing
    assert stats.is_empty()
    stats.count("hit_tokens", "device", 32)
    assert not stats.is_empty()
    gauge_only = KVBackendStats()
    gauge_only.set_gauge("pinned_blocks", "device", "scheduler", 0)
    assert not gauge_only.is_empty()  # a gauge falling to 0 must still be reported
    stats.reset()
    assert stats.is_empty()
    stats.check_invariants()


def test_ranks_add_up_and_a_later_step_replaces_a_gauge():
    step = _rank_stats("0", 100, 1000).aggregate(_rank_stats("1", 50, 700))
    assert step.data["counters"] == {"load_bytes": {"host": 150}}
    assert step.data["histograms"] == {"load_seconds": {"host": [0.5, 0.5]}}
    assert step.data["gauges"] == {"used_bytes": {"host": {"0": 1000, "1": 700}}}
    # A log interval: the same ranks a step later. Counters add, gauges are replaced.
    interval = step.aggregate(_rank_stats("0", 1, 10).aggregate(_rank_stats("1", 1, 20)))
    assert interval.reduce() == {"load_bytes[host]": 152, "load_seconds[host]_count": 4,
                                 "load_seconds[host]_mean": 0.5, "used_bytes[host]": 30}
    interval.check_invariants()


def test_payload_survives_vllms_engine_to_frontend_encoding():
    stats = _rank_stats("0", 100, 1000)
    stats.count("hit_tokens", "disk", 64)
    stats.set_gauge("pinned_blocks", "device", "scheduler", 3)
    sent = SchedulerStats(kv_connector_stats=stats.to_dict())
    received = MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(sent))
    rebuilt = KVBackendTierConnector.build_kv_connector_stats(received.kv_connector_stats)
    assert rebuilt.data == stats.data
    rebuilt.check_invariants()


def test_unknown_name_or_tier_breaks_the_invariants():
    stats = KVBackendStats()
    stats.count("hit_tokens", "gpu", 1)
    with pytest.raises(RuntimeError, match="tiers"):
        stats.check_invariants()
    stats = KVBackendStats()
    stats.count("hits", "device", 1)
    with pytest.raises(RuntimeError, match="unknown counters name 'hits'"):
        stats.check_invariants()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def _prom(registry: CollectorRegistry) -> KVBackendPromMetrics:
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    return KVBackendPromMetrics(VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]})


def test_prometheus_series_per_tier(registry):
    prom = _prom(registry)
    step = _rank_stats("0", 100, 1000).aggregate(_rank_stats("1", 50, 700))
    step.count("hit_tokens", "device", 600)
    step.set_gauge("pinned_blocks", "device", "scheduler", 4)
    prom.observe(step.to_dict())
    prom.observe(_rank_stats("0", 10, 900).to_dict())  # a later step of rank 0 only

    def value(name: str, tier: str) -> float | None:
        labels = {"model_name": "m", "engine": "0", "tier": tier}
        return registry.get_sample_value("kvbackend:" + name, labels)

    assert value("hit_tokens_total", "device") == 600
    assert value("hit_tokens_total", "host") is None
    assert value("load_bytes_total", "host") == 160
    assert value("load_seconds_count", "host") == 3
    assert value("load_seconds_sum", "host") == 1.5
    assert value("used_bytes", "host") == 900  # the latest report's sum over its sources
    assert value("pinned_blocks", "device") == 4
    prom.observe({"counters": {"no_such_series": {"host": 1}}})  # a newer engine: skipped


# ------------------------------------------------------------------- worker
ROW = 256  # bytes of one block over all layers


def test_worker_counts_what_it_moved_per_tier(tmp_path):
    """A real TierWorker on a real BlockMover, host and disk tier (rank 1 of two)."""
    cache = torch.arange(16 * ROW, dtype=torch.int64).remainder(251).to(torch.uint8)
    host = HostTier(4 * ROW)
    disk = DiskTier(tmp_path / "d", 1 << 20, make_identity(tp_rank=1, tp_size=2),
                    durable=False, rescan_interval_s=None)
    worker = TierWorker(BlockMover([cache.view(16, ROW)], 0, ROW, 4, host, disk), rank=1)
    assert worker.take_stats() is None  # nothing moved yet
    k1, k2, k3 = key_of(1), key_of(2), key_of(3)
    worker.finish_step(StepOrders(saves=(SaveOrder("r", 1, k1, True, True),
                                         SaveOrder("r", 2, k2, False, True),
                                         SaveOrder("r", 3, k3, True, False))))
    stats = worker.take_stats()
    assert stats.data["counters"] == {"save_bytes": {"host": 2 * ROW, "disk": 2 * ROW}}
    # One step: one observation per tier; k1 (host and disk) is timed as disk.
    assert {t: len(v) for t, v in stats.data["histograms"]["save_seconds"].items()} \
        == {"host": 1, "disk": 1}
    gauges = stats.data["gauges"]
    assert gauges["used_bytes"]["host"] == {"1": 2 * ROW}
    assert gauges["capacity_bytes"] == {"host": {"1": 4 * ROW}, "disk": {"1": 1 << 20}}
    assert gauges["used_bytes"]["disk"]["1"] == disk.bytes_used > 2 * ROW  # files have headers
    assert worker.take_stats() is None

    (path,) = [os.path.join(d, f) for d, _, files in os.walk(disk.base) for f in files
               if f.startswith(k2)]
    with open(path, "r+b") as f:  # k2's payload no longer matches its checksum
        f.seek(-ROW // 2, os.SEEK_END)
        byte = f.read(1)
        f.seek(-ROW // 2, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    # k1 leaves host (a drop), so it comes from disk; k3 from host; k2 fails verification.
    worker.start_step(StepOrders(drops=(k1,), loads=(LoadOrder("r", 10, k3, False),
                                                     LoadOrder("r", 11, k1, False),
                                                     LoadOrder("r", 12, k2, False))))
    assert worker.take_load_errors() == {12}
    stats = worker.take_stats()
    assert stats.data["counters"] == {"load_bytes": {"host": ROW, "disk": ROW},
                                      "verify_failed_blocks": {"disk": 1}}
    assert set(stats.data["histograms"]["load_seconds"]) == {"host", "disk"}
    assert stats.data["gauges"]["used_bytes"]["host"] == {"1": ROW}
    stats.check_invariants()


def test_worker_counts_a_hybrids_two_payload_sizes_and_a_remote_request_that_all_failed(
        server):
    """A hybrid (state group 0 of 2) on a real server: a block's ordinary copy counts one
    page, its checkpoint copy two, saved and loaded; a remote value that fails its check
    counts as a verification failure also when it was its request's only block."""
    from kvbackend.store import RemoteTier
    from kvbackend.store.remote_writer import RemoteWriter

    server.client().flushall()
    cache = torch.arange(16 * ROW, dtype=torch.int64).remainder(251).to(torch.uint8)
    before = cache.view(16, ROW).clone()
    tier = RemoteTier(server.url, make_identity(), payload_sizes=(ROW, 2 * ROW), timeout_s=5)
    mover = BlockMover([cache.view(16, ROW)], 0, 2 * ROW, 4, HostTier(8 * ROW), None,
                       state_groups=[0])
    worker = TierWorker(mover, RemoteWriter(tier, 1 << 20))
    k1, k2, k3 = key_of(1), key_of(2), key_of(3)
    worker.finish_step(StepOrders(saves=(
        SaveOrder("r", 1, k1, True, False, True, (1, 2)),
        SaveOrder("r", 1, k2, True, False, True, (1, 2), checkpoint=True),
        SaveOrder("r", 3, k3, False, False, True, (3, 4)))))
    assert worker.remote.flush(10)
    assert worker.take_stats().data["counters"] == {
        "save_bytes": {"host": 3 * ROW, "remote": 4 * ROW}}
    client = server.client()
    client.set(tier.redis_key(k3), client.get(tier.redis_key(k1)))  # k1's value: no match

    worker.start_step(StepOrders(drops=(k1, k2), loads=(
        LoadOrder("a", 5, k1, False, (5, 6)), LoadOrder("a", 7, k2, False, (7, 8), True)),
        async_loads=("a",)))
    worker.start_step(StepOrders(loads=(LoadOrder("b", 9, k3, False, (9, 10)),),
                                 async_loads=("b",)))
    finished: set[str] = set()
    for _ in range(200):
        finished |= worker.take_finished_loads()
        if finished == {"a", "b"}:
            break
        worker.reader.wait_idle(0.05)
    assert finished == {"a", "b"} and worker.take_load_errors() == {9}
    blocks = cache.view(16, ROW)
    assert torch.equal(blocks[5:7], torch.stack([before[5], before[2]]))  # k1: attention
    assert torch.equal(blocks[7:9], before[1:3])  # k2: both pages
    counters = worker.take_stats().data["counters"]
    assert counters["load_bytes"] == {"remote": 3 * ROW}
    assert counters["verify_failed_blocks"] == {"remote": 1}
    worker.close()


# ------------------------------------------------------------------ stateful
NAMES = st.sampled_from(sorted(COUNTERS))
HIST_NAMES = st.sampled_from(sorted(HISTOGRAMS))
GAUGE_NAMES = st.sampled_from(sorted(GAUGES))
TIER = st.sampled_from(TIERS)
SOURCES = st.sampled_from(["0", "1", "scheduler"])


class StatsFlow(RuleBasedStateMachine):
    """Sources record into their own stats; a step merges them (as vLLM's executor and
    scheduler do) into the interval's accumulator (as vLLM's logger does); the
    accumulator must hold the totals, every observation, and each source's last gauge."""

    @initialize()
    def start(self) -> None:
        self.pending: dict[str, KVBackendStats] = {}
        self.interval = KVBackendStats()
        self.counters: dict[tuple[str, str], int] = {}
        self.observations: dict[tuple[str, str], list[float]] = {}
        self.gauges: dict[tuple[str, str, str], int] = {}

    def _of(self, source: str) -> KVBackendStats:
        return self.pending.setdefault(source, KVBackendStats())

    @rule(source=SOURCES, name=NAMES, tier=TIER, n=st.integers(0, 1 << 40))
    def count(self, source, name, tier, n):
        self._of(source).count(name, tier, n)
        if n:
            self.counters[name, tier] = self.counters.get((name, tier), 0) + n

    @rule(source=SOURCES, name=HIST_NAMES, tier=TIER, seconds=st.floats(0, 100))
    def observe(self, source, name, tier, seconds):
        self._of(source).observe(name, tier, seconds)
        self.observations.setdefault((name, tier), []).append(seconds)

    @rule(source=SOURCES, name=GAUGE_NAMES, tier=TIER, value=st.integers(0, 1 << 40))
    def set_gauge(self, source, name, tier, value):
        self._of(source).set_gauge(name, tier, source, value)
        self.gauges[name, tier, source] = value

    @rule(order=st.permutations(["0", "1", "scheduler"]))
    def finish_step(self, order):
        step = None
        for source in order:
            stats = self.pending.pop(source, None)
            if stats is not None and not stats.is_empty():
                step = stats if step is None else step.aggregate(stats)
        if step is not None:
            payload = KVBackendTierConnector.build_kv_connector_stats(step.to_dict())
            self.interval = self.interval.aggregate(payload)

    @invariant()
    def accumulator_matches_the_model(self):
        for stats in (self.interval, *self.pending.values()):
            stats.check_invariants()
        merged = KVBackendStats().aggregate(self.interval)
        for stats in self.pending.values():
            merged.aggregate(stats)
        data = merged.data
        assert {(n, t): v for n, by in data["counters"].items() for t, v in by.items()} \
            == self.counters
        got = {(n, t): sorted(v) for n, by in data["histograms"].items() for t, v in by.items()}
        assert got == {key: sorted(v) for key, v in self.observations.items()}
        assert {(n, t, s): v for n, by in data["gauges"].items() for t, bs in by.items()
                for s, v in bs.items()} == self.gauges


TestStatsFlow = StatsFlow.TestCase
# A small structure: fewer, shorter runs than the profile's 300 examples cover it (CI time).
TestStatsFlow.settings = settings(settings.default, max_examples=100, stateful_step_count=25)
