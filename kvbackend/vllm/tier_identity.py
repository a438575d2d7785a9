"""What a vLLM engine's KV blocks depend on besides their tokens: the tiers' identity.

``tier_identity`` builds the :class:`CacheIdentity` that names a rank's blocks in
the host and disk tiers; ``block_nbytes`` is the size of one tier payload.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvbackend.store import CacheIdentity, model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def resolve_model_dir(vllm_config: VllmConfig) -> str | None:
    model = vllm_config.model_config.model
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=vllm_config.model_config.revision,
                                 local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "cannot fingerprint"
        return None


def tier_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                  tp_rank: int) -> CacheIdentity:
    """What the KV bytes of a block depend on besides its tokens. Raises ValueError
    when the model's weights cannot be fingerprinted."""
    import vllm
    from vllm.platforms import current_platform

    model_dir = resolve_model_dir(vllm_config)
    if model_dir is None:
        raise ValueError(f"cannot find the files of model {vllm_config.model_config.model!r} "
                         "to fingerprint its weights")
    (group,) = kv_cache_config.kv_cache_groups
    spec = group.kv_cache_spec
    layout = "|".join([
        f"vllm-{vllm.__version__}", current_platform.device_type, type(spec).__name__,
        f"kv_heads={spec.num_kv_heads}", f"head_size={spec.head_size}",
        f"layers={len(group.layer_names)}", f"page_bytes={spec.page_size_bytes}",
    ])
    return CacheIdentity(
        model_fingerprint=model_fingerprint(model_dir),
        kv_dtype=f"{spec.dtype}/{vllm_config.cache_config.cache_dtype}",
        block_size=spec.block_size,
        kv_layout=layout,
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        extra=(("model_dtype", str(vllm_config.model_config.dtype)),),
    )


def block_nbytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block over all layers (one tier payload)."""
    (group,) = kv_cache_config.kv_cache_groups
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


__all__ = ["block_nbytes", "resolve_model_dir", "tier_identity"]
