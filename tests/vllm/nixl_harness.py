"""Driving a decode engine from a prefill instance's KV over vLLM's NIXL connector
(``kvbackend.testing.prefill_peer`` runs the prefill instance): the shared parts of the
P/D tests."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from kvbackend.testing.prefill_peer import NIXL_BYTES, PrefillPeer
from tests.vllm.conftest import cached_by_source

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROBE = [7, 8, 9]  # a one-token request that brings the prefill engine's counts up to date


def moved_bytes(prefill: PrefillPeer, decode) -> float:
    """The bytes NIXL moved so far between the two engines: pulled (the decode engine
    counts them) or pushed (the prefill engine does; stats on)."""
    pushed = prefill.ask(PROBE, False, max_tokens=1)["nixl_bytes"]
    return pushed + sum(m.sum for m in decode.get_metrics() if m.name == NIXL_BYTES)


def decode_after(prefilled: dict, llm, prompt: list[int]) -> tuple[list[int], dict]:
    """Decode ``prompt`` on ``llm`` from the prefill instance's KV (``prefilled``: the
    peer's reply): its greedy tokens and the tokens hit per source ("device":
    kvbackend's, "p2p": moved by NIXL, "host": kvbackend's host tier)."""
    before = cached_by_source(llm)
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens,
                            extra_args={"kv_transfer_params": prefilled["params"]})
    out = generate_as(llm, get_base_request_id(prefilled["params"]["remote_request_id"]),
                      prompt, params)
    hits = {s: n - before.get(s, 0) for s, n in cached_by_source(llm).items()
            if n != before.get(s, 0)}
    return list(out.outputs[0].token_ids), hits


def generate_as(llm, request_id: str, prompt: list[int], params: SamplingParams):
    """``llm``'s finished output for ``prompt``, its request named ``request_id``: NIXL's
    push mode pairs a decode request with its prefill by the id (a P/D proxy gives
    both requests the client's)."""
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise RuntimeError(f"request {request_id} did not finish")
