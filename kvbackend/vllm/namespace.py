"""Which requests may share cached KV: the namespace of a vLLM request.

Two requests share cache entries (device tree, host and disk tiers) only when
their namespaces are equal. ``request_namespace`` is the one place that decides
what goes into it; ``namespace_bytes`` is its stable encoding inside tier keys.

A namespace is ``None`` (no adapter, no salt: shared by all) or the pair
``(adapter, cache_salt)``. The adapter is named by what it *is*, not by its name
alone, since a name can be re-pointed (unload + load, in-place reload):
``(name, path, content fingerprint)``. An adapter whose files this process cannot
read (e.g. a hub id not downloaded yet) gets ``(name, path, id, "unverified-<nonce>")``
with a nonce drawn per process: shared within the process as vLLM itself shares by
adapter, never with another process through the disk tier.

Caveat: the fingerprint is of the files when a request arrives. Rewriting an
adapter's files in place while vLLM still holds the old weights (a reload without
``load_inplace``) is not seen; load changed weights from a new path, or in place.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable

from kvbackend.store.adapter_fingerprint import Stamp, adapter_fingerprint, adapter_stamp

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

_UNVERIFIED = f"unverified-{os.urandom(8).hex()}"


def request_namespace(request: Request) -> Hashable:
    """None for the shared default namespace, else ``(adapter, cache_salt)``.
    O(1) without an adapter; one ``stat`` per adapter file with one (memoized)."""
    lora = request.lora_request
    if lora is None and request.cache_salt is None:
        return None
    return (None if lora is None else ADAPTERS.key(lora), request.cache_salt)


def namespace_bytes(namespace: Hashable) -> bytes:
    """The namespace as bytes for the tiers' block keys (same on every host and run)."""
    return b"" if namespace is None else json.dumps(list(namespace)).encode()


class AdapterKeys:
    """LoRA adapter -> its namespace key, with the fingerprints memoized in memory.

    Invariant: an entry ``path -> (directory, stamp, fingerprint)`` is used only
    while the directory's files still have that stamp, so a rewritten adapter is
    fingerprinted again. At most ``max_entries`` paths, least recently used first out.
    """

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._memo: OrderedDict[str, tuple[str, Stamp, str]] = OrderedDict()

    def key(self, lora: LoRARequest) -> tuple:
        fingerprint = self.fingerprint(lora.lora_path)
        if fingerprint is None:
            return (lora.lora_name, lora.lora_path, lora.lora_int_id, _UNVERIFIED)
        return (lora.lora_name, lora.lora_path, fingerprint)

    def fingerprint(self, path: str) -> str | None:
        """The content fingerprint of the adapter at ``path``, None if unreadable."""
        entry = self._memo.get(path)
        try:
            if entry is not None and adapter_stamp(entry[0]) == entry[1]:
                self._memo.move_to_end(path)
                return entry[2]
            directory = resolve_adapter_dir(path)
            if directory is None:
                return None
            stamp = adapter_stamp(directory)
            fingerprint = adapter_fingerprint(directory)
        except (OSError, ValueError):
            self._memo.pop(path, None)
            return None
        if adapter_stamp(directory) != stamp:  # rewritten while hashing: try next time
            return None
        self._memo[path] = (directory, stamp, fingerprint)
        self._memo.move_to_end(path)
        if len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
        return fingerprint


def resolve_adapter_dir(path: str) -> str | None:
    """The local directory vLLM loads an adapter from (``get_adapter_absolute_path``'s
    rules), without downloading: a local path, else a hub id already in the local cache."""
    local = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(local):
        return local
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "cannot fingerprint"
        return None


ADAPTERS = AdapterKeys()

__all__ = ["ADAPTERS", "AdapterKeys", "namespace_bytes", "request_namespace",
           "resolve_adapter_dir"]
