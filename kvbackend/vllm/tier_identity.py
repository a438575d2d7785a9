"""What a vLLM engine's KV blocks depend on besides their tokens: the tiers' identity.

``tier_identity`` builds the :class:`CacheIdentity` that names a rank's blocks in
the host and disk tiers; ``block_nbytes`` is the size of one whole tier payload.

Two engines share tier entries only when every input below is equal, so each one
that changes the KV bytes of the same tokens must be in it (the request's LoRA
adapter and cache salt are in the block keys, ``kvbackend.vllm.namespace``):

  * the weights and ``config.json`` (content fingerprint), and how they are loaded:
    load format (``dummy`` weights are random), loader options, model implementation
    and class overrides;
  * the *effective* Hugging Face config, after ``hf_overrides`` (RoPE scaling, ...);
  * the model dtype, online ``--quantization`` and its options;
  * the KV cache: every field of vLLM's KV cache spec (dtype, quantization mode,
    heads, head sizes, block size, padding, sliding window), the KV-cache groups (with
    several, vLLM's hybrid manager: their number, order and layers, since one payload
    holds every group's block in that order, and which groups an ordinary copy of a
    Mamba / linear-attention hybrid's block leaves out: its state groups),
    ``--kv-cache-dtype`` and its skipped layers, the resolved physical KV layout
    (vLLM's ``KVCacheLayout``, which replaced the backends' stride orders) and the
    attention backend that writes it (a state layer's state shapes, dtypes and kind
    are its spec's fields);
  * a speculative drafter that writes its KV into the same blocks (a draft model,
    EAGLE / MTP heads): its method, weights, effective config and dtype;
  * vLLM's version, the device type, the tensor-parallel rank and size.

Left out on purpose, since they do not change the bytes: ``max_model_len``, seeds,
scheduling and memory settings, served model name. (vLLM 0.32 has no
``calculate_kv_scales``: fp8 KV scales come from the checkpoint or the quantization
config, both covered.) Every value is canonical JSON, so the digest is the same in
every process and run given the same configuration.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvbackend.store import CacheIdentity, model_fingerprint

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec


def resolve_model_dir(model_config: ModelConfig) -> str | None:
    """The local directory of ``model_config``'s files (a path, or the hub cache's
    snapshot; nothing is downloaded), or None."""
    model = model_config.model
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=model_config.revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "cannot fingerprint"
        return None


def _weights_fingerprint(model_config: ModelConfig) -> str:
    model_dir = resolve_model_dir(model_config)
    if model_dir is None:
        raise ValueError(f"cannot find the files of model {model_config.model!r} "
                         "to fingerprint its weights")
    return model_fingerprint(model_dir)


def tier_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                  tp_rank: int) -> CacheIdentity:
    """What the KV bytes of a block depend on besides its tokens (module docstring).
    Raises ValueError when the model's weights cannot be fingerprinted. O(config size)
    after the first fingerprint of the weights (memoized)."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = kv_cache_config.kv_cache_groups
    # the first group of token KV (a state group's dtypes are in its spec's fields)
    spec = next((g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, AttentionSpec)),
                groups[0].kv_cache_spec)
    model, cache, load = vllm_config.model_config, vllm_config.cache_config, vllm_config.load_config
    # The attention layers' backend (a state layer's state layout is in its spec; the
    # scheduler process, which loads no model, resolves only the default backend).
    layer_names = [name for group in groups if isinstance(group.kv_cache_spec, AttentionSpec)
                   for name in group.layer_names]
    layout = "|".join([
        f"vllm-{vllm.__version__}", current_platform.device_type, *_group_layout(groups),
        f"kv_cache_layout={kv_cache_config.kv_cache_layout or cache.kv_cache_layout}",
        f"attention_backend={_attention_backends(vllm_config, layer_names)}",
    ])
    extra = {
        "model_dtype": model.dtype,
        "hf_config": _digest(_effective_hf_config(model.hf_config)),
        "quantization": model.quantization,
        "quantization_config": model.quantization_config,
        "load_format": load.load_format,
        "model_loader_extra_config": _digest(load.model_loader_extra_config),
        "model_impl": model.model_impl,
        "model_class_overrides": model.model_class_overrides,
        "kv_cache_dtype_skip_layers": cache.kv_cache_dtype_skip_layers,
    }
    drafter = _drafter(vllm_config)
    if drafter is not None:  # only then: the digests of other configurations stay as they were
        extra["drafter"] = drafter
    return CacheIdentity(
        model_fingerprint=_weights_fingerprint(model),
        kv_dtype=f"{spec.dtype}/{cache.cache_dtype}",
        block_size=spec.block_size,
        kv_layout=layout,
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        extra=tuple((name, _canonical(value)) for name, value in extra.items()),
    )


def _drafter(vllm_config: VllmConfig) -> dict | None:
    """A speculative drafter that writes KV into the same blocks (a draft model, EAGLE /
    MTP heads): its method, weights, effective config and dtype, and for multi-module MTP
    how many modules write KV (the rest leave their layers unwritten); None for drafters
    without KV (n-gram, suffix, Medusa, MLP speculators)."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.uses_draft_kv_cache():
        return None
    draft = spec.draft_model_config
    modules = None
    if spec.use_multi_module_mtp():
        modules = min(getattr(draft.hf_config, "num_nextn_predict_layers", 1),
                      spec.num_speculative_tokens)
    return {"method": spec.method, "weights": _weights_fingerprint(draft),
            "hf_config": _digest(_effective_hf_config(draft.hf_config)),
            "dtype": draft.dtype, "modules_writing_kv": modules}


def logical_block_size(kv_cache_config: KVCacheConfig) -> int:
    """Tokens of one logical block (kvbackend's tree and tier block): the least common
    multiple of the attention groups' block sizes (vLLM's scheduler block; a state
    group's block in "align" mode is that size). O(groups)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
             if not isinstance(g.kv_cache_spec, MambaSpec)]
    if not sizes:
        return kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    return math.lcm(*sizes)


def pages_per_block(kv_cache_config: KVCacheConfig) -> list[int]:
    """Each group's blocks in one logical block (``block_groups.BlockGroups``; a state
    group: one). O(groups)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    logical = logical_block_size(kv_cache_config)
    return [1 if isinstance(g.kv_cache_spec, MambaSpec) else logical // g.kv_cache_spec.block_size
            for g in kv_cache_config.kv_cache_groups]


def block_nbytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one tier block: every layer's blocks of every group in one logical block
    (one payload; ``pages_per_block``)."""
    return sum(pages * group.kv_cache_spec.page_size_bytes * len(group.layer_names)
               for pages, group in zip(pages_per_block(kv_cache_config),
                                       kv_cache_config.kv_cache_groups))


def _group_layout(groups: Sequence[KVCacheGroupSpec]) -> list[str]:
    """Each group's spec and layers, in vLLM's group order (a tier payload holds the
    groups in that order), with the number of groups when there are several and the
    state groups an ordinary payload leaves out: a payload written with one group
    layout never matches another."""
    from vllm.v1.kv_cache_interface import MambaSpec

    parts = [f"{type(g.kv_cache_spec).__name__}{_canonical(_fields(g.kv_cache_spec))}"
             f"|layers={len(g.layer_names)}" for g in groups]
    if len(groups) == 1:
        return parts
    state = [n for n, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    return [f"groups={len(groups)}",
            *(f"{part}:{_canonical(g.layer_names)}" for part, g in zip(parts, groups)),
            *([f"ordinary_payload_leaves_out={state}"] if state else [])]


def _attention_backends(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    """The attention backend(s) of these layers, as vLLM's KV connectors resolve them
    (the layers' own where the model is loaded in this process, else vLLM's selector)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = get_current_attn_backends(vllm_config, layer_names)
    return ",".join(sorted(backend.get_name() for backend in backends))


def _effective_hf_config(hf_config: Any) -> dict:
    """The model's Hugging Face config as vLLM uses it (``hf_overrides`` applied),
    without the private keys that name where it was loaded from (``_name_or_path``)."""
    return {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_")}


def _fields(spec: Any) -> dict:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def _canonical(value: Any) -> str:
    """Compact JSON with sorted keys; sets sorted, enums by name, other objects by str()."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {type(value).__name__: _plain(_fields(value))}
    return str(value)


def _digest(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()


__all__ = ["block_nbytes", "resolve_model_dir", "tier_identity"]
