"""The tier connector under vLLM's real scheduler, one step at a time (``TierHarness``).

Each test reproduces a way the tiers used to go wrong: a crash inside
``Scheduler.schedule()``, KV computed on top of another rank's failed load
being saved, a block never saved again once its disk file was evicted, KV from
before ``reset_prefix_cache(reset_connector=True)`` served afterwards, and hit
sources that vLLM's stats loggers cannot label.
"""

from __future__ import annotations

import os
import random

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tests.vllm.conftest import BLOCK_SIZE
from tests.vllm.tier_harness import TierHarness, base_config

NUM_BLOCKS = 24  # vLLM's null block + 23 usable


@pytest.fixture(scope="module")
def config(tiny_model):
    return base_config(tiny_model)


def prompt(seed: int, num_blocks: int) -> list[int]:
    """``num_blocks`` full blocks plus one token (so every full block can be a hit)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(num_blocks * BLOCK_SIZE + 1)]


def external_hits(harness: TierHarness, output, request_id: str) -> int:
    """Tokens of ``request_id`` the connector supplied in the step of ``output``."""
    request = harness.requests[request_id]
    return request.num_computed_tokens - output.num_scheduled_tokens[request_id]


def test_a_disk_block_promoted_into_a_full_host_tier_keeps_the_requests_host_blocks(config,
                                                                                     tmp_path):
    """A document whose first block left host memory before its later blocks: the
    first block comes from disk and is promoted into the full host tier, which must
    not evict the request's own next blocks (it raised KeyError inside schedule())."""
    harness = TierHarness(config, num_blocks=NUM_BLOCKS, host_blocks=4, disk_dir=str(tmp_path))
    document, other = prompt(1, 4), prompt(2, 1)
    harness.add("doc", document)
    harness.run()  # host: blocks 0-3 of the document; disk: the same
    harness.add("other", other)
    harness.run()  # host is full: the document's block 0 (least recently used) leaves host
    assert harness.scheduler.reset_prefix_cache()  # the device forgets everything
    harness.add("doc-again", document)
    output = harness.step()  # loads block 0 from disk and blocks 1-3 from host
    assert external_hits(harness, output, "doc-again") == 4 * BLOCK_SIZE
    harness.run()
    harness.add("doc-third", document)  # all four blocks are still served
    assert harness.scheduler.reset_prefix_cache()
    output = harness.step()
    assert external_hits(harness, output, "doc-third") == 4 * BLOCK_SIZE


def test_saves_wait_until_a_requests_loads_are_known_good_on_every_rank(config, tmp_path):
    """The step that loads a request's blocks computes the rest of its prompt on top
    of them. If another rank failed to load one of them, vLLM (which reports the
    union of failed blocks) recomputes from there, and nothing computed in that step
    may reach a tier, on any rank: the disk tier never overwrites a file."""
    harness = TierHarness(config, num_blocks=NUM_BLOCKS, disk_dir=str(tmp_path))
    document = prompt(3, 4)
    harness.add("doc", document[: 4 * BLOCK_SIZE + 1])
    harness.run()
    assert len(harness.disk_files()) == 4
    assert harness.scheduler.reset_prefix_cache()
    longer = document[: 4 * BLOCK_SIZE] + prompt(4, 3)  # blocks 4-6 are new
    harness.add("longer", longer)
    output = harness.schedule()
    assert external_hits(harness, output, "longer") == 4 * BLOCK_SIZE
    failed_elsewhere = {harness.block_ids("longer")[2]}  # rank 1 could not load block 2
    files = harness.disk_files()
    harness.execute(output, other_rank_failures=failed_elsewhere)
    assert harness.disk_files() == files, "blocks computed on a failed load were saved"
    assert harness.requests["longer"].num_computed_tokens == 2 * BLOCK_SIZE  # vLLM recomputes
    harness.run()
    assert len(harness.disk_files()) == 7  # blocks 4-6 saved once recomputed


def test_a_block_whose_disk_file_was_evicted_is_saved_again(config, tmp_path):
    """Another process (or this worker's size bound) evicting a file must not stop the
    block from being saved the next time it is computed."""
    harness = TierHarness(config, num_blocks=NUM_BLOCKS, disk_dir=str(tmp_path))
    document = prompt(5, 3)
    harness.add("doc", document)
    harness.run()
    files = harness.disk_files()
    assert len(files) == 3
    for path in harness.disk_paths():
        os.unlink(path)  # evicted behind the scheduler's back
    assert harness.scheduler.reset_prefix_cache()
    harness.add("doc-again", document)
    output = harness.step()
    assert external_hits(harness, output, "doc-again") == 0
    harness.run()
    assert harness.disk_files() == files


def test_reset_connector_serves_nothing_computed_before_from_any_tier(config, tmp_path):
    """``reset_prefix_cache(reset_connector=True)`` follows a weight update (RLHF, sleep /
    wake_up): nothing computed before it may be served afterwards, from host or disk,
    and the disk files, named by the weight files' fingerprint, no longer describe the
    weights in memory."""
    harness = TierHarness(config, num_blocks=NUM_BLOCKS, host_blocks=8, disk_dir=str(tmp_path))
    document = prompt(6, 3)
    harness.add("doc", document)
    harness.run()
    files = harness.disk_files()
    assert len(files) == 3
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)
    harness.add("after-update", document)
    output = harness.step()
    assert external_hits(harness, output, "after-update") == 0
    harness.run()
    assert harness.disk_files() == files  # nothing of the new weights under the old identity
    assert harness.scheduler.reset_prefix_cache()  # the device only: the host tier serves
    harness.add("again", document)
    output = harness.step()
    assert external_hits(harness, output, "again") == 3 * BLOCK_SIZE


def test_hit_sources_are_vllms_cache_hit_source(config, tmp_path):
    harness = TierHarness(config, num_blocks=NUM_BLOCKS, disk_dir=str(tmp_path), log_stats=True)
    document = prompt(7, 3)
    harness.add("doc", document)
    harness.run()
    assert harness.scheduler.reset_prefix_cache()
    harness.add("again", document)
    harness.schedule()
    sources = harness.scheduler.connector_prefix_cache_stats.hits_by_source
    assert sources == {CacheHitSource.DISK: 3 * BLOCK_SIZE}
    assert all(isinstance(source, CacheHitSource) for source in sources)
    assert [source.value for source in sources] == ["disk"]  # as Prometheus labels them

