"""kvbackend's host-memory and disk tiers inside the real vLLM engine.

Four engines start here, one after the other, each shut down before the next:
  A  tiny model, disk dir D, small host tier, device KV for 47 blocks: computes
     the restart prompts, then a round-robin over more documents than fit.
  B  a new process on D: first-sight hits from disk; a flipped byte and a
     truncated file are detected and recomputed.
  C  a model with the same config but other weights, on D: no hits at all.
  D  an unwritable disk directory: a warning, correct outputs.
Greedy outputs are compared token for token with vLLM without any cache.
"""

from __future__ import annotations

import glob
import os
import random

import pytest
from vllm import SamplingParams

from kvbackend.store.disk_tier import FORMAT_DIR
from kvbackend.testing.tiny_model import build_tiny_llama
from kvbackend.vllm import engine_kwargs
from tests.vllm.conftest import BLOCK_SIZE, generate, make_engine, shutdown
from tests.vllm.conftest import random_tokens as tokens

BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers * (K, V) * kv heads * head dim * float32
DEVICE_BLOCKS = 48  # block 0 is vLLM's null block: 47 usable, 1504 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def tier_engine(model: str, **tiers):
    return make_engine(model, "kvbackend", max_model_len=1024, disable_log_stats=False,
                       kv_cache_memory_bytes=DEVICE_BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN,
                       **engine_kwargs(**tiers))


def run(llm, prompts, params=GREEDY):
    return generate(llm, prompts, params)


def aligned(n: int) -> int:
    """The longest block-aligned hit a prompt of n tokens can get (capped at n - 1)."""
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def block_files(directory) -> set[str]:
    return set(glob.glob(os.path.join(str(directory), FORMAT_DIR, "*", "*", "*.kvb")))


class Prompts:
    _rng = random.Random(7)
    restart = tokens(_rng, 600)
    flipped = tokens(_rng, 300)
    truncated = tokens(_rng, 300)
    documents = [tokens(_rng, 400), tokens(_rng, 400), tokens(_rng, 400), tokens(_rng, 400),
                 tokens(_rng, 400)]  # 2000 tokens > 1504 on the device


@pytest.fixture(scope="module")
def reference(reference_llm):
    """No-cache outputs of every prompt of this module, by prompt."""
    prompts = [Prompts.restart, Prompts.flipped, Prompts.truncated, *Prompts.documents]
    outputs = run(reference_llm, prompts)
    return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)}


def check(outputs, prompts, reference):
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == reference[tuple(prompt)]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def engine_a_files(tiny_model, disk_dir, reference):
    """Engine A: computes the restart prompts, then round-robins the documents.
    Returns (round-robin outputs, the block files each restart prompt wrote)."""
    llm = tier_engine(tiny_model, host_cache_gb=0.01, disk_cache_dir=str(disk_dir))
    try:
        written = {}
        for name in ("restart", "flipped", "truncated"):
            before = block_files(disk_dir)
            check(run(llm, [getattr(Prompts, name)]), [getattr(Prompts, name)], reference)
            written[name] = sorted(block_files(disk_dir) - before, key=os.path.getmtime)
        rounds = [run(llm, [doc]) for _ in range(3) for doc in Prompts.documents]
    finally:
        shutdown(llm)
    return rounds, written


def test_host_tier_serves_prefixes_evicted_from_the_device(engine_a_files, reference):
    rounds, _ = engine_a_files
    docs = Prompts.documents
    for i, (out,) in enumerate(rounds):
        check([out], [docs[i % len(docs)]], reference)
    later = [out for (out,) in rounds[len(docs):]]
    # Five 400-token documents do not fit in 1504 device tokens: round-robin evicts
    # each before its turn comes again, so every later hit comes from the host tier.
    assert [o.num_cached_tokens for o in later] == [aligned(400)] * len(later)


def test_restart_reuses_disk_and_detects_bad_files(engine_a_files, tiny_model, disk_dir, reference,
                                                   capfd):
    _, written = engine_a_files
    assert len(written["restart"]) == 600 // BLOCK_SIZE
    # Damage one block of each damage prompt between the runs (files in write order).
    victim = written["flipped"][3]
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    short = written["truncated"][5]
    os.truncate(short, os.path.getsize(short) // 2)

    llm = tier_engine(tiny_model, disk_cache_dir=str(disk_dir))  # B: a new process
    try:
        (out,) = run(llm, [Prompts.restart])
        check([out], [Prompts.restart], reference)
        assert out.num_cached_tokens >= aligned(600)
        for name in ("flipped", "truncated"):
            prompt = getattr(Prompts, name)
            (out,) = run(llm, [prompt])  # loads the damaged block: detected, recomputed
            check([out], [prompt], reference)
            (again,) = run(llm, [prompt])
            check([again], [prompt], reference)
    finally:
        shutdown(llm)
    err = _logs(capfd)
    assert err.count("failed to load from host/disk; they are recomputed") == 2, err[-3000:]
    assert "dropping bad block file" in err
    # The bad files were dropped and the recomputed blocks written again, intact.
    from kvbackend.store.block_file import CorruptBlock, read_block
    for path in (victim, short):
        assert os.path.exists(path)
        with open(path, "rb") as f:
            digest_dir = os.path.basename(os.path.dirname(os.path.dirname(path)))
            key = os.path.basename(path)[:-4]
            try:
                read_block(f, os.path.getsize(path), digest_dir, key)
            except CorruptBlock as e:
                pytest.fail(f"{path} is still corrupt: {e}")


def test_other_weights_get_no_hits_from_the_same_directory(engine_a_files, tmp_path_factory,
                                                           disk_dir):
    other = build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-seed1")), seed=1)
    files_before = block_files(disk_dir)
    llm = tier_engine(other, disk_cache_dir=str(disk_dir))
    try:
        outs = run(llm, [Prompts.restart, *Prompts.documents[:2]])
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    finally:
        shutdown(llm)
    identities = {os.path.dirname(os.path.dirname(p)) for p in block_files(disk_dir) - files_before}
    assert identities and not identities & {os.path.dirname(os.path.dirname(p))
                                            for p in files_before}


def test_unwritable_disk_dir_warns_and_serves(tiny_model, tmp_path, reference, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    llm = tier_engine(tiny_model, disk_cache_dir=str(blocker / "cache"))
    try:
        for _ in range(2):
            outs = run(llm, [Prompts.restart, Prompts.documents[0]])
            check(outs, [Prompts.restart, Prompts.documents[0]], reference)
    finally:
        shutdown(llm)
    err = _logs(capfd)
    assert "kvbackend" in err and "disk tier" in err and "cannot write" in err


def _logs(capfd) -> str:
    """Both streams: the engine-core process logs kvbackend's lines through vLLM's
    handler (stdout), or to stderr where vLLM's logging is not configured."""
    captured = capfd.readouterr()
    return captured.out + captured.err


def test_engine_kwargs_select_the_tier_connector_only_with_a_tier():
    from vllm.config import KVTransferConfig

    from kvbackend.vllm import KVBackendConfig
    from kvbackend.vllm.connectors import is_tier_connector

    assert "kv_transfer_config" not in engine_kwargs()
    kv = engine_kwargs(host_cache_gb=2, disk_cache_dir="/tmp/x", disk_cache_gb=0.5)
    config = kv["kv_transfer_config"]
    assert config["kv_connector_module_path"] == "kvbackend.vllm.tiers.connector"
    assert config["kv_role"] == "kv_both" and config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]  # what the connector rebuilds its settings from
    assert KVBackendConfig.from_dict(extra) == KVBackendConfig(
        host_cache_gb=2, disk_cache_dir="/tmp/x", disk_cache_gb=0.5)
    assert kv["additional_config"]["kvbackend"]["host_cache_gb"] == 2
    assert is_tier_connector(KVTransferConfig(**config))
    assert not is_tier_connector(KVTransferConfig(kv_connector="OffloadingConnector",
                                                  kv_role="kv_both"))
    assert not is_tier_connector(None)
    for bad in (dict(host_cache_gb=-1), dict(disk_cache_gb="1"), dict(disk_cache_dir=5),
                dict(disk_cache_dir=""), dict(host_cache_gb=float("inf")),
                dict(host_cache_gb=True)):
        with pytest.raises(ValueError, match="kvbackend"):
            engine_kwargs(**bad)
