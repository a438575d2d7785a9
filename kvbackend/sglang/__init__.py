"""SGLang adapter: a prefix cache for ``--radix-cache-backend kvbackend`` and a HiCache L3
storage backend. Only this package imports sglang; nothing in the core imports it.

* ``radix_cache``: ``KVBackendRadixCache``, a ``BasePrefixCache`` over kvbackend's ``RadixTree``
* ``plugin``: the ``sglang.srt.plugins`` entry point that registers it
* ``hicache_storage``: ``KVBackendHiCacheStorage``, pages in kvbackend's ``DiskTier``
"""
