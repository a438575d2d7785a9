"""The ``sglang.srt.plugins`` entry point: ``--radix-cache-backend kvbackend``.

SGLang runs every entry point of that group in the launcher and in each
scheduler process, before it builds the tree cache; ``register`` adds our
factory to SGLang's radix-cache registry there.
"""

from __future__ import annotations

BACKEND_NAME = "kvbackend"


def create_radix_cache(ctx):
    """Factory for SGLang's registry (``TreeCacheBuildContext -> BasePrefixCache``)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory
    from sglang.srt.runtime_context import get_memory

    from kvbackend.sglang.radix_cache import KVBackendRadixCache

    if ctx.disable_radix_cache:
        return default_radix_cache_factory(ctx)  # SGLang's "no prefix cache" tree
    memory = get_memory()
    # LMCache and FlexKV drive their own tree's host events every step
    # (check_hicache_events, is_backuped): a plain prefix cache cannot serve them.
    unsupported = [name for name, on in (("hybrid SWA models", ctx.is_hybrid_swa),
                                         ("hybrid SSM (Mamba) models", ctx.is_hybrid_ssm),
                                         ("--enable-hierarchical-cache",
                                          ctx.enable_hierarchical_cache),
                                         ("--enable-lmcache", memory.enable_lmcache),
                                         ("--enable-flexkv", memory.enable_flexkv)) if on]
    if unsupported:
        raise ValueError(f"--radix-cache-backend {BACKEND_NAME} does not support "
                         f"{', '.join(unsupported)}; drop the flag to use SGLang's own cache")
    return KVBackendRadixCache(ctx.params)


def register() -> None:
    """Register the ``kvbackend`` radix-cache backend; idempotent."""
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_radix_cache)
