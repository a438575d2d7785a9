"""KV events (``--kv-events-config``) from kvbackend, read off the engine's real ZMQ
publisher, against those of vLLM's own prefix caching on the same workload."""

from __future__ import annotations

import glob
import os
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

from kvbackend.store.disk_tier import FORMAT_DIR  # noqa: E402
from kvbackend.testing.tiny_model import build_tiny_gemma3, build_tiny_qwen3_next  # noqa: E402
from kvbackend.vllm import engine_kwargs  # noqa: E402
from kvbackend.vllm.kv_events import DISK, HOST  # noqa: E402

from tests.vllm.conftest import (  # noqa: E402
    BLOCK_SIZE, cached_by_source, generate, make_engine, random_tokens, shutdown,
)
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


def announced_blocks(model: str, mode: str, endpoint: str, batches: list[list[list[int]]],
                     **overrides) -> list[BlockStored]:
    """Run ``batches`` on a fresh engine; every ``BlockStored`` it published."""
    def run(llm):
        for batch in batches:
            llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    events = published_events(model, mode, endpoint, run, **overrides)
    return [e for e in events if isinstance(e, BlockStored)]


def by_hash(events: list[BlockStored]) -> dict:
    """(group, hash) -> (parent hash, token ids, the group's spec fields), one entry per
    announced block of each KV-cache group. An event whose token ids are not its
    blocks' (vLLM's sliding-window groups list only the blocks still in the window,
    with the whole range's token ids and no parent) gives None for both."""
    blocks = {}
    for event in events:
        parent = event.parent_block_hash
        spec = (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
        aligned = len(event.token_ids) == event.block_size * len(event.block_hashes)
        for i, block_hash in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * event.block_size:(i + 1) * event.block_size])
            blocks[event.group_idx, block_hash] = (parent, tokens, spec) if aligned else (
                None, None, spec)
            parent = block_hash
    return blocks


def check_covers(ours: dict, theirs: dict, block_size: int = BLOCK_SIZE) -> None:
    """Every block vLLM announced (in every group) is announced by kvbackend alike
    (where vLLM's event names its tokens; else its hash and group spec)."""
    assert theirs, "vLLM's prefix caching announced nothing; the workload is wrong"
    missing = set(theirs) - set(ours)
    assert not missing, f"{len(missing)} of vLLM's {len(theirs)} blocks not announced"
    for key, (parent, tokens, spec) in theirs.items():
        expected = (parent, tokens, spec) if tokens is not None else (*ours[key][:2], spec)
        assert ours[key] == expected
    hashes = {block_hash for _, block_hash in ours}
    for parent, tokens, _ in ours.values():  # every chain starts at a first block
        assert parent is None or parent in hashes  # (of another group: a state group's)
        assert len(tokens) == block_size


def test_kvbackend_announces_every_block_vllm_announces_with_its_hashes(tiny_model, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # one NONE_HASH seed in both engines
    ours = by_hash(announced_blocks(tiny_model, "kvbackend", f"ipc://{tmp_path}/kvb", workload()))
    theirs = by_hash(announced_blocks(tiny_model, "vllm-apc", f"ipc://{tmp_path}/apc",
                                      workload()))
    check_covers(ours, theirs)


GEMMA3 = dict(max_model_len=1024, kv_cache_memory_bytes=4 << 20)  # as test_sliding_window.py


def test_every_kv_cache_group_of_a_sliding_window_model_is_announced_as_vllm_does(
        tmp_path, monkeypatch):
    """The Gemma-3-style model (two sliding-window groups, one full-attention group):
    vLLM announces each group's blocks with its ``group_idx`` and spec fields; the
    workload's shared prompt is longer than the window, so vLLM announces only the
    window's blocks of the sliding-window groups, kvbackend every block of each."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    gemma = build_tiny_gemma3(str(tmp_path / "gemma3"))
    ours = by_hash(announced_blocks(gemma, "kvbackend", f"ipc://{tmp_path}/kvb", workload(),
                                    **GEMMA3))
    theirs = by_hash(announced_blocks(gemma, "vllm-apc", f"ipc://{tmp_path}/apc", workload(),
                                      **GEMMA3))
    check_covers(ours, theirs)
    assert {group for group, _ in theirs} == {0, 1, 2}
    assert {spec for _, _, spec in theirs.values()} == {("sliding_window", 64),
                                                        ("full_attention", None)}


STATE_BLOCK = 288  # the tiny Qwen3-Next's block, once vLLM fits a state page in one
QWEN3_NEXT = dict(dtype="bfloat16", kv_cache_memory_bytes=64 << 20, max_model_len=2048,
                  max_num_batched_tokens=2048,
                  mamba_ssm_cache_dtype="bfloat16")  # as test_state_hybrid.py: 288-token blocks


def test_a_hybrids_state_group_is_announced_where_it_holds_checkpoints_as_vllm_does(
        tmp_path, monkeypatch):
    """The tiny Qwen3-Next (group 0: a Gated DeltaNet state in "align" mode; group 1:
    full attention; 288-token blocks), prompts one at a time, each prefilled in one
    step. vLLM keeps (and announces) a state block only where a step ended on its
    last token; kvbackend announces a block's state page only there too, so its state
    group's announcements are vLLM's, hash for hash: not the first block of a
    two-block prompt. Its attention group covers vLLM's."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    model = build_tiny_qwen3_next(str(tmp_path / "qwen3-next"))
    rng = random.Random(3)
    system = random_tokens(rng, 2 * STATE_BLOCK + 40)
    conversation = random_tokens(rng, STATE_BLOCK + 100)
    prompts = [system + random_tokens(rng, 40), system + random_tokens(rng, 30),
               conversation, conversation + random_tokens(rng, 300)]
    ours, theirs = (by_hash(announced_blocks(model, mode, f"ipc://{tmp_path}/{mode}",
                                             [[p] for p in prompts], **QWEN3_NEXT))
                    for mode in ("kvbackend", "vllm-apc"))
    check_covers(ours, theirs, STATE_BLOCK)
    state = {key for key, (_, _, spec) in ours.items() if spec[0] == "mamba"}
    assert state == {key for key, (_, _, spec) in theirs.items() if spec[0] == "mamba"}
    assert {group for group, _ in state} == {0}
    assert len(state) < len(ours) - len(state)  # not every attention block's state


HOST_BLOCKS = 4


def held_by_tier(events: list) -> dict[tuple, set]:
    """Replay ``events``: the block hashes each (medium, locality) holds at the end."""
    held: dict[tuple, set] = {}
    for event in events:
        tier = (getattr(event, "medium", None), getattr(event, "locality", None))
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored):
            held.setdefault(tier, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.get(tier, set()).difference_update(event.block_hashes)
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
        assert by_hash([event]) == {(0, h): device[0, h] for h in event.block_hashes}
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU]
    assert removed, "the host tier evicted blocks but announced no removal"
    held = held_by_tier(events)
    assert held[HOST] == set(hashes_of(document, device))  # the host holds the document only


def hashes_of(prompt: list[int], device: dict) -> list:
    """The announced hash of each full block of ``prompt``, in order (``device``:
    ``by_hash`` of the device's announcements)."""
    hashes = []
    for i in range(len(prompt) // BLOCK_SIZE):
        tokens = tuple(prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        parent = hashes[-1] if hashes else None
        (found,) = [h for (_, h), block in device.items() if block[:2] == (parent, tokens)]
        hashes.append(found)
    return hashes


def test_disk_blocks_are_announced_and_removed_once_a_lookup_finds_them_gone(tiny_model,
                                                                            tmp_path):
    """A document's 4 blocks go to disk (announced "STORAGE", locality "LOCAL", as
    vLLM's file-system tier does, under the device blocks' hashes). Another process
    evicts one block file, unseen; after the device forgets everything, the
    document's lookup finds that file missing: announced removed, then written and
    announced again once recomputed."""
    rng = random.Random(5)
    document = [rng.randrange(3, 512) for _ in range(4 * BLOCK_SIZE + 1)]
    disk = tmp_path / "disk"
    found = {}

    def run(llm):
        llm.generate([{"prompt_token_ids": document}], GREEDY, use_tqdm=False)
        files = sorted(glob.glob(os.path.join(str(disk), FORMAT_DIR, "*", "*", "*.kvb")))
        assert len(files) == 4
        os.remove(files[0])  # some block of the document, evicted elsewhere
        assert llm.reset_prefix_cache()
        (again,) = llm.generate([{"prompt_token_ids": document}], GREEDY, use_tqdm=False)
        found["cached"] = again.num_cached_tokens

    events = published_events(tiny_model, "kvbackend", f"ipc://{tmp_path}/events", run,
                              max_model_len=512, **engine_kwargs(disk_cache_dir=str(disk)))
    stored = [e for e in events if isinstance(e, BlockStored)]
    device = by_hash([e for e in stored if e.medium == MEDIUM_GPU])
    on_disk = [e for e in stored if (e.medium, e.locality) == DISK]
    for event in on_disk:  # the device block's announcement, medium and locality aside
        assert by_hash([event]) == {(0, h): device[0, h] for h in event.block_hashes}
    hashes = hashes_of(document, device)
    removed = [h for e in events if isinstance(e, BlockRemoved) and (e.medium, e.locality) == DISK
               for h in e.block_hashes]
    assert removed == [hashes[found["cached"] // BLOCK_SIZE]]  # where the lookup stopped
    assert held_by_tier(events)[DISK] == set(hashes)  # written again


def test_blocks_prefetched_from_disk_into_host_are_announced_there(tiny_model, tmp_path):
    """A document's blocks leave the 4-block host tier (4 one-block prompts after it)
    and the device; it then arrives queued behind another prompt (one request runs at a
    time), so its disk blocks are prefetched into host memory on arrival and it loads
    them from there. The host copies are announced ("CPU", the disk copies' hashes)
    when the prefetch is ordered, not only copies that a save or a load put there."""
    rng = random.Random(7)
    document = random_tokens(rng, 4 * BLOCK_SIZE + 1)
    others = [random_tokens(rng, BLOCK_SIZE + 1) for _ in range(4)]
    short = random_tokens(rng, 10)  # no full block: saves nothing
    moved = {}

    def run(llm):
        for prompt in (document, *others):
            generate(llm, [prompt], GREEDY)
        assert llm.reset_prefix_cache()
        before = cached_by_source(llm)
        generate(llm, [short, document], GREEDY)
        after = cached_by_source(llm)
        moved.update({tier: after.get(tier, 0) - before.get(tier, 0) for tier in after})

    events = published_events(tiny_model, "kvbackend", f"ipc://{tmp_path}/prefetch", run,
                              max_model_len=512, max_num_seqs=1, disable_log_stats=False,
                              **engine_kwargs(host_cache_gb=host_gb(HOST_BLOCKS),
                                              disk_cache_dir=str(tmp_path / "disk")))
    assert moved.get("host") == 4 * BLOCK_SIZE and not moved.get("disk"), moved  # prefetched
    stored = [e for e in events if isinstance(e, BlockStored)]
    device = by_hash([e for e in stored if e.medium == MEDIUM_GPU])
    assert set(hashes_of(document, device)) <= held_by_tier(events)[HOST]
