"""Engine-agnostic persistent tier store for KV blocks: never imports vLLM, SGLang or torch.

* ``identity``: ``CacheIdentity`` and ``model_fingerprint`` (what the KV depends on)
* ``block_key``: chained sha256 block keys (which prefix a block holds)
* ``host_tier``: in-memory LRU tier; ``disk_tier``: persistent, checksummed file tier;
  ``remote_tier``: blocks in a Redis/Valkey server (``circuit_breaker``: its retry rule;
  ``health_probe``: the health checks of an outage; ``remote_reader``/``remote_writer``:
  read-behind and write-behind), imported on first use of ``RemoteTier`` (the
  ``redis`` client takes ~0.25 s to import)
* ``block_file``: the on-disk block format (documented in ``disk_tier``); ``layout``: the
  names in a cache directory; ``safe_fs``: the directory's trust rules and no-follow I/O;
  ``checksum_key``: keyed checksums; ``disk_index``, ``disk_bound``, ``backoff``, ``scan``:
  the disk tier's index, shared size bound, retry delays and directory walker
"""

from kvbackend.store.block_key import chain_key, checkpoint_key, compute_block_keys
from kvbackend.store.disk_tier import DiskTier
from kvbackend.store.host_tier import HostTier
from kvbackend.store.identity import CacheIdentity, model_fingerprint
from kvbackend.store.tier import Payload, TierStore

__all__ = [
    "CacheIdentity", "DiskTier", "HostTier", "Payload", "RemoteTier", "TierStore", "chain_key",
    "checkpoint_key", "compute_block_keys", "model_fingerprint",
]


def __getattr__(name: str):
    if name == "RemoteTier":
        from kvbackend.store.remote_tier import RemoteTier
        return RemoteTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
