"""Driving a decode engine from a prefill instance's KV over vLLM's NIXL connector
(``kvbackend.testing.prefill_peer`` runs the prefill instance): the shared parts of the
P/D tests."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from kvbackend.testing.prefill_peer import decode_prefilled
from tests.vllm.conftest import cached_by_source, cached_since

GREEDY = SamplingParams(temperature=0, max_tokens=8)
NIXL_MODES = ("NixlConnector", "NixlPushConnector")


@pytest.fixture(scope="module", params=NIXL_MODES)
def nixl(request) -> dict:
    """NIXL's connector config, in pull mode (the decode instance reads) or push mode (the
    prefill instance writes; the two requests share an id, as a P/D proxy gives them)."""
    return {"kv_connector": request.param, "kv_role": "kv_both"}


def decode_after(prefilled: dict, llm, prompt: list[int]) -> tuple[list[int], dict]:
    """Decode ``prompt`` on ``llm`` from the prefill instance's KV (``prefilled``: the
    peer's reply): its greedy tokens and the tokens hit per source ("device":
    kvbackend's, "p2p": moved by NIXL, "host": kvbackend's host tier)."""
    before = cached_by_source(llm)
    out = decode_prefilled(llm, prefilled, prompt, GREEDY)
    return list(out.outputs[0].token_ids), cached_since(llm, before)
