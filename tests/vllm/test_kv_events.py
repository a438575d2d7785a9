"""KV events (``--kv-events-config``) from kvbackend, read off the engine's real ZMQ
publisher, against those of vLLM's own prefix caching on the same workload."""

from __future__ import annotations

import random
import time

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import BlockStored, KVEventBatch  # noqa: E402

from tests.vllm.conftest import BLOCK_SIZE, make_engine, shutdown  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def workload() -> list[list[list[int]]]:
    """Batches of prompts: a shared system prompt (ending inside a block), questions
    on it, a salted tenant, and a conversation that grows by one turn."""
    rng = random.Random(11)
    words = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    system = words(5 * BLOCK_SIZE + 9)
    conversation = words(3 * BLOCK_SIZE + 20)
    return [[system + words(40)],
            [system + words(30 + i) for i in range(3)] + [conversation],
            [conversation + words(50)]]


def announced_blocks(model: str, mode: str, endpoint: str) -> list[BlockStored]:
    """Run the workload on a fresh engine; every ``BlockStored`` it published."""
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    llm = make_engine(model, mode, kv_events_config=config)
    socket = zmq.Context.instance().socket(zmq.SUB)
    try:
        socket.connect(endpoint)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(1.0)  # ZMQ's slow joiner: let the subscription reach the publisher
        for batch in workload():
            llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        stored = []
        while socket.poll(2000):
            _topic, _seq, payload = socket.recv_multipart()
            stored += [e for e in decoder.decode(payload).events if isinstance(e, BlockStored)]
        return stored
    finally:
        socket.close(linger=0)
        shutdown(llm)


def by_hash(events: list[BlockStored]) -> dict:
    """hash -> (parent hash, token ids), one entry per announced block."""
    blocks = {}
    for event in events:
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
            blocks[block_hash] = (parent, tuple(tokens))
            parent = block_hash
    return blocks


def test_kvbackend_announces_every_block_vllm_announces_with_its_hashes(tiny_model, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # one NONE_HASH seed in both engines
    ours = by_hash(announced_blocks(tiny_model, "kvbackend", f"ipc://{tmp_path}/kvb"))
    theirs = by_hash(announced_blocks(tiny_model, "vllm-apc", f"ipc://{tmp_path}/apc"))
    assert theirs, "vLLM's prefix caching announced nothing; the workload is wrong"
    missing = set(theirs) - set(ours)
    assert not missing, f"{len(missing)} of vLLM's {len(theirs)} blocks not announced"
    for block_hash, (parent, tokens) in theirs.items():
        assert ours[block_hash] == (parent, tokens)
    for parent, tokens in ours.values():  # every chain starts at a first block
        assert parent is None or parent in ours
        assert len(tokens) == BLOCK_SIZE
