"""The user-facing configuration of kvbackend inside vLLM.

The same keys arrive from ``--kv-backend-config JSON`` and from
``kvbackend.vllm.engine_kwargs(**config)``; they travel to the engine-core
process inside ``VllmConfig.additional_config["kvbackend"]``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

ADDITIONAL_CONFIG_KEY = "kvbackend"


@dataclass(frozen=True)
class KVBackendConfig:
    """``max_pinned_fraction``: at most this share of the KV blocks may be pinned
    by ``kv_pin`` requests (the rest stays available, so pins cannot starve
    the engine)."""

    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        value = self.max_pinned_fraction
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"kvbackend: max_pinned_fraction must be a number in [0, 1], got {value!r}")

    @classmethod
    def from_dict(cls, raw: Any) -> KVBackendConfig:
        """Validate a mapping of keys; unknown keys are an error, not ignored."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"kvbackend: the configuration must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kvbackend: unknown configuration key(s) {unknown}; "
                             f"known keys: {sorted(known)}")
        return cls(**raw)

    @classmethod
    def from_json(cls, text: str) -> KVBackendConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kvbackend: --kv-backend-config is not valid JSON ({e}): {text!r}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
