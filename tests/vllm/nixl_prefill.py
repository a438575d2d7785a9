"""A prefill instance for ``test_nixl.py``: a real vLLM engine with kvbackend and vLLM's
NIXL connector, run in its own process (a NIXL peer must be another process), driven one
JSON line at a time.

    python -m tests.vllm.nixl_prefill MODEL KV_CACHE_BYTES   (env VLLM_NIXL_SIDE_CHANNEL_PORT)

Prints "ready", then answers each line ``{"prompt": [...], "remote_decode": bool}`` with
``{"params": ..., "tokens": [...]}``, each of its lines after ``REPLY`` (vLLM logs to
stdout too): with ``remote_decode`` the request is prefilled for
a decode instance (one token; ``params`` is what that instance needs to pull its KV, which
this engine holds until it did), else it is served here (``tokens``: 4 greedy ones).
"""

from __future__ import annotations

import json
import sys

REPLY = "nixl_prefill: "


def main() -> None:
    from vllm import SamplingParams

    from kvbackend.vllm import engine_kwargs
    from tests.vllm.conftest import make_engine

    model, kv_cache_bytes = sys.argv[1], int(sys.argv[2])
    llm = make_engine(model, "kvbackend", max_model_len=512, kv_cache_memory_bytes=kv_cache_bytes,
                      **engine_kwargs({"kv_connector": "NixlConnector", "kv_role": "kv_both"}))
    print(REPLY + "ready", flush=True)
    for line in sys.stdin:
        order = json.loads(line)
        extra = {"kv_transfer_params": {"do_remote_decode": True}} if order["remote_decode"] else {}
        params = SamplingParams(temperature=0, max_tokens=1 if extra else 4, extra_args=extra)
        (out,) = llm.generate([{"prompt_token_ids": order["prompt"]}], params, use_tqdm=False)
        print(REPLY + json.dumps({"params": out.kv_transfer_params,
                          "tokens": list(out.outputs[0].token_ids)}), flush=True)


if __name__ == "__main__":
    main()
