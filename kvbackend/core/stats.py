"""Per-namespace prefix-cache counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class NamespaceStats:
    """Counters for one namespace; all monotone."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
