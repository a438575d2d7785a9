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
from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
)

from kvbackend.vllm import engine_kwargs  # noqa: E402

from tests.vllm.conftest import BLOCK_SIZE, make_engine, shutdown  # noqa: E402
from tests.vllm.tier_harness import host_gb  # noqa: E402

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


def published_events(model: str, mode: str, endpoint: str, run, **overrides) -> list:
    """Every event a fresh engine published while ``run(llm)`` ran, in order."""
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    llm = make_engine(model, mode, kv_events_config=config, **overrides)
    socket = zmq.Context.instance().socket(zmq.SUB)
    try:
        socket.connect(endpoint)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(1.0)  # ZMQ's slow joiner: let the subscription reach the publisher
        run(llm)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events = []
        while socket.poll(2000):
            _topic, _seq, payload = socket.recv_multipart()
            events += decoder.decode(payload).events
        return events
    finally:
        socket.close(linger=0)
        shutdown(llm)


def announced_blocks(model: str, mode: str, endpoint: str) -> list[BlockStored]:
    """Run the workload on a fresh engine; every ``BlockStored`` it published."""
    def run(llm):
        for batch in workload():
            llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    events = published_events(model, mode, endpoint, run)
    return [e for e in events if isinstance(e, BlockStored)]


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


HOST_BLOCKS = 4


def held_by_medium(events: list) -> dict[str, set]:
    """Replay ``events``: the block hashes each medium holds at the end."""
    held: dict[str, set] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored):
            held.setdefault(event.medium, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.get(event.medium, set()).difference_update(event.block_hashes)
    return held


def test_host_tier_blocks_are_announced_with_the_device_blocks_hashes(tiny_model, tmp_path):
    """A 4-block host tier: a document's 4 blocks go to it, another prompt's 2 evict
    two of them; after the device forgets everything, the document comes back, its
    first 2 blocks from disk (put into the host tier again: announced once the device
    announces the loaded blocks) and its last 2 from the host."""
    rng = random.Random(3)
    document = [rng.randrange(3, 512) for _ in range(4 * BLOCK_SIZE + 1)]
    other = [rng.randrange(3, 512) for _ in range(2 * BLOCK_SIZE + 1)]

    def run(llm):
        for prompt in (document, other):
            llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        assert llm.reset_prefix_cache()
        (again,) = llm.generate([{"prompt_token_ids": document}], GREEDY, use_tqdm=False)
        assert again.num_cached_tokens == 4 * BLOCK_SIZE

    events = published_events(tiny_model, "kvbackend", f"ipc://{tmp_path}/tiers", run,
                              max_model_len=512, **engine_kwargs(
                                  host_cache_gb=host_gb(HOST_BLOCKS),
                                  disk_cache_dir=str(tmp_path / "disk")))
    stored = [e for e in events if isinstance(e, BlockStored)]
    device = by_hash([e for e in stored if e.medium == MEDIUM_GPU])
    host = [e for e in stored if e.medium == MEDIUM_CPU]
    assert host, "no host tier block was announced"
    for event in host:  # the device block's announcement, medium aside
        assert by_hash([event]) == {h: device[h] for h in event.block_hashes}
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU]
    assert removed, "the host tier evicted blocks but announced no removal"
    held = held_by_medium(events)
    document_blocks = {h for h, (_, tokens) in device.items()
                       if list(tokens) in [document[i:i + BLOCK_SIZE]
                                           for i in range(0, 4 * BLOCK_SIZE, BLOCK_SIZE)]}
    assert len(document_blocks) == 4
    assert held[MEDIUM_CPU] == document_blocks  # the host tier holds the document only
