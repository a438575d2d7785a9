"""Driving a decode engine from a prefill instance's KV over vLLM's NIXL connector
(``kvbackend.testing.prefill_peer`` runs the prefill instance): the shared parts of the
P/D tests."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from kvbackend.testing.prefill_peer import NIXL_BYTES, PrefillPeer, decode_prefilled
from tests.vllm.conftest import cached_by_source

GREEDY = SamplingParams(temperature=0, max_tokens=8)
NIXL_MODES = ("NixlConnector", "NixlPushConnector")
PROBE = [7, 8, 9]  # a one-token request that brings the prefill engine's counts up to date


@pytest.fixture(scope="module", params=NIXL_MODES)
def nixl(request) -> dict:
    """NIXL's connector config, in pull mode (the decode instance reads) or push mode (the
    prefill instance writes; the two requests share an id, as a P/D proxy gives them)."""
    return {"kv_connector": request.param, "kv_role": "kv_both"}


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
    out = decode_prefilled(llm, prefilled, prompt, GREEDY)
    hits = {s: n - before.get(s, 0) for s, n in cached_by_source(llm).items()
            if n != before.get(s, 0)}
    return list(out.outputs[0].token_ids), hits
