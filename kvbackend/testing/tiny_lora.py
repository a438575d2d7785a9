"""Build a tiny random LoRA adapter (PEFT layout) for the tiny Llama of ``tiny_model``.

Nothing is downloaded: ``adapter_model.safetensors`` holds random ``lora_A`` /
``lora_B`` matrices for the attention projections of every layer (``k_proj`` and
``v_proj`` included, so the adapter changes the KV cache), and
``adapter_config.json`` is what vLLM's PEFT loader reads. Deterministic per seed.
"""

from __future__ import annotations

import json
import os

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_tiny_lora(path: str, base_model: str, *, rank: int = 8, seed: int = 0,
                    scale: float = 0.5) -> str:
    """Write an adapter for the model in ``base_model`` into ``path``; return ``path``.

    ``scale`` sets the entries' standard deviation: large enough that greedy outputs
    of the base model and the adapter differ.
    """
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(base_model, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv_out = config["num_key_value_heads"] * head_dim
    out_features = {"q_proj": hidden, "k_proj": kv_out, "v_proj": kv_out, "o_proj": hidden}
    in_features = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": hidden}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = scale * torch.randn(
                rank, in_features[module], generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = scale * torch.randn(
                out_features[module], rank, generator=generator)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(TARGET_MODULES), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    return path


__all__ = ["TARGET_MODULES", "build_tiny_lora"]
