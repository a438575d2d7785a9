"""kvbackend's per-tier numbers in vLLM's ``/metrics``, through vLLM's KV-connector stats.

How they travel (vLLM 0.32): after each step in which a worker moved blocks, its
connector's ``get_kv_connector_stats`` returns a ``KVBackendStats``; vLLM merges the
TP ranks' objects with ``aggregate``, adds the scheduler-side connector's (hits per
tier, device occupancy and pins), sends ``to_dict()`` to the API process inside
``SchedulerStats``, where ``KVBackendPromMetrics.observe`` records it. vLLM's periodic
"KV Transfer metrics" log line prints ``reduce()`` of the interval.

Series; labels: vLLM's ``model_name`` and ``engine``, and ``tier`` (device, host,
disk, remote). With TP > 1, what each means over the ranks:

  kvbackend:hit_tokens_total           prompt tokens a request got from this tier when it
                                       was admitted (device: the token-exact tree hit; host,
                                       disk, remote: tokens adopted for loading, counted as
                                       vLLM's prompt_tokens_cached_by_source counts them: a
                                       load that then fails is recomputed). Counted once per
                                       request by the scheduler, whatever the TP size.
  kvbackend:load_bytes_total           bytes loaded from this tier into the device cache,
  kvbackend:save_bytes_total           and saved into it (remote: handed to the remote
                                       writer, which sends them from its own thread): the sum
                                       over ranks (each rank moves its own heads' share).
  kvbackend:load_seconds               histograms: one observation per rank and step that
  kvbackend:save_seconds               moved blocks of the tier, the time that rank spent on
                                       them in the step (a block saved to host and disk counts
                                       as disk: one gather serves both). TP = N gives N
                                       observations per step.
  kvbackend:verify_failed_blocks_total blocks read from disk or the remote tier that failed
                                       verification (checksum, identity, size) and were
                                       dropped and recomputed; summed over ranks.
  kvbackend:used_bytes                 gauges: bytes the tier holds and may hold, summed over
  kvbackend:capacity_bytes             ranks (device: blocks with content, cached or in use;
                                       disk: the files each rank's index knows, capacity its
                                       share of disk_cache_gb). Not for remote: the server,
                                       shared by a fleet, knows its own size.
  kvbackend:pinned_blocks              gauge, device only: blocks pinned by kv_pin requests
                                       (a block spans every rank; counted once).

Without a tier (no host, disk or remote cache) vLLM runs no KV connector, and only a
connector's stats reach ``/metrics``: then no ``kvbackend:`` series is exported, and
device hits show in vLLM's own ``vllm:prefix_cache_hits_total``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics, KVConnectorStats,
)

PREFIX = "kvbackend:"
TIERS = ("device", "host", "disk", "remote")
COUNTERS = {
    "hit_tokens": "Prompt tokens served from this tier at admission.",
    "load_bytes": "Bytes loaded from this tier into the device KV cache, over all ranks.",
    "save_bytes": "Bytes saved from the device KV cache into this tier, over all ranks.",
    "verify_failed_blocks": "Blocks read from this tier that failed verification (recomputed).",
}
HISTOGRAMS = {
    "load_seconds": "Seconds one rank spent in one step loading this tier's blocks.",
    "save_seconds": "Seconds one rank spent in one step saving blocks to this tier.",
}
GAUGES = {
    "used_bytes": "Bytes this tier holds, over all ranks.",
    "capacity_bytes": "Bytes this tier may hold, over all ranks.",
    "pinned_blocks": "Device blocks pinned by kv_pin requests.",
}
LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
SECTIONS = ("counters", "histograms", "gauges")


@dataclass
class KVBackendStats(KVConnectorStats):
    """One or more steps' numbers, as plain dicts with string keys (they cross processes):

        {"counters":   {name: {tier: total}},
         "histograms": {name: {tier: [seconds, ...]}},
         "gauges":     {name: {tier: {source: latest value}}}}

    ``source`` names who set a gauge (a rank, or the scheduler). ``aggregate`` adds
    counters, concatenates observations and keeps each source's later gauge value, so
    merging ranks (different sources) and merging steps (the same sources) are both
    right; ``observe`` in Prometheus sums a gauge over its sources.

    Invariants (``check_invariants``): exactly the three sections; every name is one
    of COUNTERS / HISTOGRAMS / GAUGES in its section and every tier one of TIERS;
    counters and gauges are non-negative numbers; observations are lists of
    non-negative numbers. O(1) per recorded value, nothing per block.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {section: {} for section in SECTIONS}

    def count(self, name: str, tier: str, n: int) -> None:
        """Add ``n`` to a counter (nothing for 0)."""
        if n:
            by_tier = self.data["counters"].setdefault(name, {})
            by_tier[tier] = by_tier.get(tier, 0) + n

    def observe(self, name: str, tier: str, seconds: float) -> None:
        self.data["histograms"].setdefault(name, {}).setdefault(tier, []).append(seconds)

    def set_gauge(self, name: str, tier: str, source: str, value: int) -> None:
        self.data["gauges"].setdefault(name, {}).setdefault(tier, {})[source] = value

    def aggregate(self, other: KVConnectorStats) -> KVBackendStats:
        """Merge ``other`` (the later one, or another rank's) into this object."""
        data = other.data
        for name, by_tier in data.get("counters", {}).items():
            for tier, n in by_tier.items():
                self.count(name, tier, n)
        for name, by_tier in data.get("histograms", {}).items():
            mine = self.data["histograms"].setdefault(name, {})
            for tier, values in by_tier.items():
                mine.setdefault(tier, []).extend(values)
        for name, by_tier in data.get("gauges", {}).items():
            mine = self.data["gauges"].setdefault(name, {})
            for tier, by_source in by_tier.items():
                mine.setdefault(tier, {}).update(by_source)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One value per series and tier for the log line: counters' totals, a
        histogram's count and mean, a gauge summed over its sources."""
        out: dict[str, int | float] = {}
        for name, by_tier in self.data["counters"].items():
            out.update({f"{name}[{tier}]": n for tier, n in by_tier.items()})
        for name, by_tier in self.data["histograms"].items():
            for tier, values in by_tier.items():
                out[f"{name}[{tier}]_count"] = len(values)
                out[f"{name}[{tier}]_mean"] = round(sum(values) / len(values), 6) if values else 0
        for name, by_tier in self.data["gauges"].items():
            out.update({f"{name}[{tier}]": sum(s.values()) for tier, s in by_tier.items()})
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(section) for section in SECTIONS)

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant (plain raises, so
        ``python -O`` keeps them). O(values)."""
        if set(self.data) != set(SECTIONS):
            raise RuntimeError(f"sections {sorted(self.data)}")
        for section, known in zip(SECTIONS, (COUNTERS, HISTOGRAMS, GAUGES)):
            for name, by_tier in self.data[section].items():
                if name not in known:
                    raise RuntimeError(f"unknown {section} name {name!r}")
                if not set(by_tier) <= set(TIERS):
                    raise RuntimeError(f"{name}: tiers {sorted(by_tier)}")
                for value in by_tier.values():
                    values = (value if section == "histograms" else
                              value.values() if section == "gauges" else [value])
                    if not all(isinstance(v, int | float) and v >= 0 for v in values):
                        raise RuntimeError(f"{name}: {value!r}")


class KVBackendPromMetrics(KVConnectorPromMetrics):
    """The ``kvbackend:`` series (see the module docstring), registered once per API
    process; ``observe`` records one ``KVBackendStats.to_dict()``. Names it does not
    know (a newer engine core) are skipped. O(values) per observe."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()  # a second engine in this process registers them again
        labels = [*labelnames, "tier"]
        self._metrics: dict[str, tuple[str, Any]] = {}
        for name, doc in COUNTERS.items():
            self._metrics[name] = ("counters", self._counter_cls(
                name=PREFIX + name, documentation=doc, labelnames=labels))
        for name, doc in HISTOGRAMS.items():
            self._metrics[name] = ("histograms", self._histogram_cls(
                name=PREFIX + name, documentation=doc, labelnames=labels,
                buckets=LATENCY_BUCKETS))
        for name, doc in GAUGES.items():
            self._metrics[name] = ("gauges", self._gauge_cls(
                name=PREFIX + name, documentation=doc, labelnames=labels,
                multiprocess_mode="mostrecent"))
        self._children: dict[tuple[int, str, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for section in SECTIONS:
            for name, by_tier in transfer_stats_data.get(section, {}).items():
                if self._metrics.get(name, ("",))[0] != section:
                    continue
                for tier, value in by_tier.items():
                    child = self._child(engine_idx, name, tier)
                    if section == "counters":
                        child.inc(value)
                    elif section == "gauges":
                        child.set(sum(value.values()))
                    else:
                        for seconds in value:
                            child.observe(seconds)

    def _child(self, engine_idx: int, name: str, tier: str) -> Any:
        key = (engine_idx, name, tier)
        child = self._children.get(key)
        if child is None:
            labels = [*self.per_engine_labelvalues[engine_idx], tier]
            child = self._children[key] = self._metrics[name][1].labels(*labels)
        return child


def _unregister_ours() -> None:
    """Drop ``kvbackend:`` collectors from the default registry, as vLLM does with its
    own (``unregister_vllm_metrics``) before it registers them again."""
    for name, collector in list(REGISTRY._names_to_collectors.items()):
        if name.startswith(PREFIX):
            try:
                REGISTRY.unregister(collector)
            except KeyError:  # a collector of several names, already dropped
                pass


__all__ = ["KVBackendPromMetrics", "KVBackendStats", "TIERS"]
