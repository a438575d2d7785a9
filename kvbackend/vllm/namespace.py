"""Which requests may share cached KV: the namespace of a vLLM request.

Two requests share cache entries (device tree, host and disk tiers) only when
their namespaces are equal. ``request_namespace`` is the one place that decides
what goes into it; ``namespace_bytes`` is its stable encoding inside tier keys.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from vllm.v1.request import Request


def request_namespace(request: Request) -> Hashable:
    """None for the shared default namespace, else a tuple naming the LoRA
    adapter and the cache salt. O(1)."""
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    if lora is None and request.cache_salt is None:
        return None
    return (lora, request.cache_salt)


def namespace_bytes(namespace: Hashable) -> bytes:
    """The namespace as bytes for the tiers' block keys (same on every host and run)."""
    return b"" if namespace is None else json.dumps(list(namespace)).encode()


__all__ = ["namespace_bytes", "request_namespace"]
