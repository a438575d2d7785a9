"""Build tiny random-weight models (Llama; Gemma-3; Gemma 4; Qwen3-Next; MiMo with an MTP
layer; EAGLE, EAGLE-3 and DFlash drafters) for tests and benchmarks.

Nothing is downloaded: the model is randomly initialised and the tokenizer is a
word-level vocabulary (``<unk> <s> </s> w0 w1 ...``) built in memory, so that
``"w5 w17 w3"`` encodes to three tokens.

The Gemma-3 model interleaves sliding-window and full-attention layers, so vLLM
gives it more than one KV-cache group (one per layer kind and position). The
Qwen3-Next model is a linear-attention (Gated DeltaNet) / full-attention hybrid:
vLLM gives its linear-attention layers a state group (``MambaSpec``).

Usage: ``python -m kvbackend.testing.tiny_model DIR [--gemma3 | --qwen3-next] [--seed 1 ...]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_PARAMS_KEY = "kvbackend_tiny_llama"  # the parameters a directory was built with


def build_tiny_llama(
    path: str,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 8192,
    seed: int = 0,
    dtype: str = "float32",
) -> str:
    """Create (or reuse) a random Llama + word-level tokenizer in ``path``; return ``path``.

    Deterministic for a given ``seed``. If ``path/config.json`` was written by an
    earlier call with the same parameters, nothing is rebuilt. vLLM's CPU attention
    needs ``hidden_size // num_heads`` in {32, 64, 80, 96, 112, 128, ...}.
    """
    params = dict(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
        seed=seed, dtype=dtype,
    )

    def make_config():
        from transformers import LlamaConfig
        return LlamaConfig(
            hidden_size=hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            intermediate_size=intermediate_size, vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings,
            bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)

    return _build(path, params, make_config)


def build_tiny_gemma3(
    path: str,
    *,
    layer_types: tuple[str, ...] = ("sliding_attention", "sliding_attention", "full_attention"),
    sliding_window: int = 64,
    seed: int = 0,
    dtype: str = "float32",
) -> str:
    """Create (or reuse) a random text-only Gemma-3 (``Gemma3ForCausalLM``) in ``path``.

    ``layer_types`` interleaves ``"sliding_attention"`` (a window of ``sliding_window``
    tokens) and ``"full_attention"`` layers, as Gemma 3 does (5:1 there, 2:1 here).
    Hidden size 128, two query heads and one KV head of 64 (a head size vLLM's CPU
    attention takes), 512 words. Reuse and determinism as in ``build_tiny_llama``.
    """
    params = dict(arch="gemma3", layer_types=list(layer_types), sliding_window=sliding_window,
                  seed=seed, dtype=dtype, vocab_size=512, max_position_embeddings=8192)

    def make_config():
        from transformers import Gemma3TextConfig
        config = Gemma3TextConfig(
            hidden_size=128, num_hidden_layers=len(layer_types), head_dim=64,
            num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
            vocab_size=params["vocab_size"], query_pre_attn_scalar=64,
            max_position_embeddings=params["max_position_embeddings"],
            sliding_window=sliding_window, layer_types=list(layer_types),
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
        config.architectures = ["Gemma3ForCausalLM"]
        return config

    return _build(path, params, make_config)


def build_tiny_gemma4(path: str, *, sliding_window: int = 64, seed: int = 0) -> str:
    """Create (or reuse) a random text-only Gemma 4 (``Gemma4ForCausalLM``) in ``path``:
    a sliding-window layer (``sliding_window`` tokens, head size 32) then a
    full-attention layer (head size 64), two KV heads each, hidden size 128, 512 words.
    Its full-attention layer holds twice the KV bytes per token, so vLLM gives the
    sliding-window group twice the block size. Reuse and determinism as in
    ``build_tiny_llama``.
    """
    params = dict(arch="gemma4", sliding_window=sliding_window, seed=seed, dtype="float32",
                  vocab_size=512, max_position_embeddings=8192)

    def make_config():
        from transformers import Gemma4TextConfig
        return Gemma4TextConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, global_head_dim=64, intermediate_size=128,
            vocab_size=params["vocab_size"], sliding_window=sliding_window,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=params["max_position_embeddings"],
            bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Gemma4ForCausalLM"])

    return _build(path, params, make_config)


def build_tiny_qwen3_next(path: str, *, seed: int = 0) -> str:
    """Create (or reuse) a random Qwen3-Next (``Qwen3NextForCausalLM``) in ``path``: one
    Gated DeltaNet linear-attention layer, then one full-attention layer, 512 words.

    Saved in bfloat16 with linear-attention head dims of 128: vLLM's CPU kernel for these
    layers takes nothing else. vLLM needs a sparse-MoE layer in the model, so the second
    layer's MLP is a tiny MoE. The linear-attention state decays slowly (``A`` of 1e-3
    per head instead of a random 0.01-16, which forgets within a few tokens), so the
    outputs depend on the state hundreds of tokens back: a hit that resumed from a wrong
    state would show in them. Reuse and determinism as in ``build_tiny_llama``.
    """
    params = dict(arch="qwen3_next", seed=seed, dtype="bfloat16", vocab_size=512,
                  max_position_embeddings=8192, state_decay=1e-3)

    def make_config():
        from transformers import Qwen3NextConfig
        config = Qwen3NextConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=128, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, mlp_only_layers=[0],
            decoder_sparse_step=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, vocab_size=params["vocab_size"],
            max_position_embeddings=params["max_position_embeddings"],
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
        config.architectures = ["Qwen3NextForCausalLM"]
        return config

    def slow_decay(model) -> None:
        import torch
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                with torch.no_grad():
                    layer.linear_attn.A_log.fill_(math.log(params["state_decay"]))

    return _build(path, params, make_config, prepare=slow_decay)


def build_tiny_eagle(path: str, *, hidden_size: int = 128, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int = 128, vocab_size: int = 512,
                     seed: int = 1) -> str:
    """Create (or reuse) a random EAGLE drafter in ``path`` for a ``build_tiny_llama``
    model of the same sizes: vLLM's ``EagleLlamaForCausalLM`` format, one decoder layer
    without an input norm, ``fc`` from the token embedding and the target's hidden state
    to the layer's input, the target's embedding and LM head shared. Reuse and
    determinism as in ``build_tiny_llama``.
    """
    params = dict(arch="eagle", hidden_size=hidden_size, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                  vocab_size=vocab_size, seed=seed, dtype="float32",
                  max_position_embeddings=8192)

    def make_config():
        from transformers import LlamaConfig
        return LlamaConfig(
            hidden_size=hidden_size, num_hidden_layers=1, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            max_position_embeddings=params["max_position_embeddings"],
            bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"])

    def eagle_weights(model) -> dict:
        import torch
        weights = {name.removeprefix("model."): tensor.contiguous()
                   for name, tensor in model.state_dict().items()
                   if name.startswith("model.layers.") and "input_layernorm" not in name}
        hidden = model.config.hidden_size
        weights["fc.weight"] = torch.randn(hidden, 2 * hidden) / math.sqrt(2 * hidden)
        return weights

    return _build(path, params, make_config, export=eagle_weights)


def build_tiny_eagle3(path: str, *, seed: int = 1) -> str:
    """Create (or reuse) a random EAGLE-3 drafter in ``path`` for ``build_tiny_llama``'s
    default model: vLLM's ``Eagle3LlamaForCausalLM`` format, one decoder layer
    (``midlayer``: attention over the token embedding and the previous hidden state,
    concatenated), ``fc`` from the target's hidden states before its layer 0, after it and
    after its layer 1, its own norm and LM head, the target's embedding shared. Reuse and
    determinism as in ``build_tiny_llama``.
    """
    hidden, heads, kv_heads, head_dim, inter, vocab = 128, 4, 2, 32, 128, 512
    params = dict(arch="eagle3", seed=seed, dtype="float32", vocab_size=vocab,
                  max_position_embeddings=8192)

    def make_config():
        from transformers import LlamaConfig
        return LlamaConfig(
            hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
            num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
            max_position_embeddings=params["max_position_embeddings"],
            bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False,
            architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=vocab,
            eagle_aux_hidden_state_layer_ids=[0, 1, 2])

    def eagle3_weights(model) -> dict:
        import torch

        def linear(rows: int, cols: int):
            return torch.randn(rows, cols) / math.sqrt(cols)

        layer = {"self_attn.q_proj": linear(heads * head_dim, 2 * hidden),
                 "self_attn.k_proj": linear(kv_heads * head_dim, 2 * hidden),
                 "self_attn.v_proj": linear(kv_heads * head_dim, 2 * hidden),
                 "self_attn.o_proj": linear(hidden, heads * head_dim),
                 "mlp.gate_proj": linear(inter, hidden), "mlp.up_proj": linear(inter, hidden),
                 "mlp.down_proj": linear(hidden, inter)}
        weights = {f"midlayer.{name}.weight": w for name, w in layer.items()}
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            weights[f"midlayer.{norm}.weight"] = torch.ones(hidden)
        weights.update({"fc.weight": linear(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
                        "lm_head.weight": linear(vocab, hidden)})
        return weights

    return _build(path, params, make_config, export=eagle3_weights)


def build_tiny_dflash(path: str, *, causal: bool = False, sliding_window: int | None = None,
                      seed: int = 1) -> str:
    """Create (or reuse) a random DFlash drafter in ``path`` for ``build_tiny_llama``'s
    default model: vLLM's ``DFlashDraftModel`` format (``DFlashQwen3ForCausalLM``), one
    Qwen3 decoder layer that drafts a block of mask tokens at once (bidirectionally
    within the block unless ``causal``), its context K/V projected from the target's
    hidden states after its layers 0 and 1 (``fc``, ``hidden_norm``), its own norm and LM
    head, the target's embedding shared; ``<unk>`` is the mask token. With
    ``sliding_window`` the layer attends to that many tokens (vLLM gives it a KV-cache
    group of its own). Reuse and determinism as in ``build_tiny_llama``.
    """
    hidden, heads, kv_heads, head_dim, inter, vocab = 128, 4, 2, 32, 128, 512
    params = dict(arch="dflash", causal=causal, sliding_window=sliding_window, seed=seed,
                  dtype="float32", vocab_size=vocab, max_position_embeddings=8192)
    window = {"use_swa": True, "swa_window_size": sliding_window} if sliding_window else {}

    def make_config():
        from transformers import Qwen3Config
        return Qwen3Config(
            hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
            vocab_size=vocab, max_position_embeddings=params["max_position_embeddings"],
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
            architectures=["DFlashDraftModel"],
            dflash_config={"mask_token_id": 0, "target_layer_ids": [0, 1], "causal": causal,
                           **window})

    def dflash_weights(model) -> dict:
        import torch
        weights = {name.removeprefix("model."): tensor.contiguous()
                   for name, tensor in model.state_dict().items()
                   if name.startswith("model.layers.") or name == "lm_head.weight"}
        weights["fc.weight"] = torch.randn(hidden, 2 * hidden) / math.sqrt(2 * hidden)
        weights["hidden_norm.weight"] = torch.ones(hidden)
        weights["norm.weight"] = torch.ones(hidden)
        return weights

    return _build(path, params, make_config, export=dflash_weights)


def build_tiny_mimo(path: str, *, seed: int = 0) -> str:
    """Create (or reuse) a random MiMo (``MiMoForCausalLM``: a Qwen2 with a multi-token
    prediction layer) in ``path``: two decoder layers of ``build_tiny_llama``'s default
    sizes, and one MTP layer (vLLM's ``MiMoMTPModel``, speculative method ``mtp``),
    which reads the token embedding and the model's last hidden state, 512 words. Reuse
    and determinism as in ``build_tiny_llama``.
    """
    params = dict(arch="mimo", seed=seed, dtype="float32", vocab_size=512,
                  max_position_embeddings=8192)

    def make_config():
        from transformers import Qwen2Config
        return Qwen2Config(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=params["vocab_size"],
            max_position_embeddings=params["max_position_embeddings"],
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
            architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)

    def with_mtp_layer(model) -> dict:
        import torch
        weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        hidden = model.config.hidden_size
        block = {name.removeprefix("model.layers.0."): tensor for name, tensor in weights.items()
                 if name.startswith("model.layers.0.")}
        mtp = {name: torch.randn_like(tensor) / math.sqrt(tensor.shape[-1])
               if tensor.dim() > 1 else torch.zeros_like(tensor)
               for name, tensor in block.items() if "layernorm" not in name}
        for norm in ("input_layernorm", "post_attention_layernorm", "token_layernorm",
                     "hidden_layernorm", "final_layernorm"):
            mtp[f"{norm}.weight"] = torch.ones(hidden)
        mtp["input_proj.weight"] = torch.randn(hidden, 2 * hidden) / math.sqrt(2 * hidden)
        weights.update({f"model.mtp_layers.0.{name}": tensor for name, tensor in mtp.items()})
        return weights

    return _build(path, params, make_config, export=with_mtp_layer)


def _build(path: str, params: dict, make_config: Callable,
           prepare: Callable | None = None, export: Callable | None = None) -> str:
    """Save a random model from ``make_config()`` (then ``prepare(model)``, if given) and
    the word-level tokenizer into ``path``, unless ``path`` already holds one built with
    ``params``. ``export(model)``, if given, names the tensors saved instead of the
    model's own."""
    config_path = os.path.join(path, "config.json")
    if os.path.exists(config_path):
        with open(config_path) as f:
            if json.load(f).get(_PARAMS_KEY) == params:
                return path
    vocab_size, max_len = params["vocab_size"], params["max_position_embeddings"]
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}")

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    config = make_config()
    setattr(config, _PARAMS_KEY, params)
    torch.manual_seed(params["seed"])
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, params["dtype"])).eval()
    if prepare is not None:
        prepare(model)

    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=max_len,
    )

    # Save into a temp dir under path, then move config.json last, so an interrupted
    # build is never mistaken for a finished one.
    os.makedirs(path, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny_model_", dir=path)
    try:
        if export is None:
            model.save_pretrained(tmp)
        else:
            from safetensors.torch import save_file
            save_file(export(model), os.path.join(tmp, "model.safetensors"))
            config.save_pretrained(tmp)
        hf_tok.save_pretrained(tmp)
        names = sorted(os.listdir(tmp), key=lambda n: n == "config.json")
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(path, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--gemma3", action="store_true",
                        help="the Gemma-3-style model (only --seed, --dtype, "
                             "--sliding-window apply)")
    parser.add_argument("--qwen3-next", action="store_true",
                        help="the linear-attention hybrid (only --seed applies)")
    parser.add_argument("--sliding-window", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--max-position-embeddings", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    args = vars(parser.parse_args(argv))
    path, window = args.pop("path"), args.pop("sliding_window")
    if args.pop("gemma3"):
        print(build_tiny_gemma3(path, sliding_window=window, seed=args["seed"],
                                dtype=args["dtype"]))
    elif args.pop("qwen3_next"):
        print(build_tiny_qwen3_next(path, seed=args["seed"]))
    else:
        print(build_tiny_llama(path, **args))


if __name__ == "__main__":
    main()
