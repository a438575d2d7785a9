"""Stateful property test of the tier planner against a model of vLLM and two TP ranks.

The planner (``kvbackend.vllm.tiers.planner``) is driven the way vLLM's
scheduler drives the connector: admissions (lookup, allocation), chunked
prefill and decode steps, preemption, aborts, failure reports and
``reset_prefix_cache(reset_connector=True)``; arriving requests are prefetched
now and then (``add_request``), and finished ones ask ``kv_retain_s`` (a step is a
second of the retention clock). The two ranks
are real: each has a KV tensor, a ``HostTier``, a ``DiskTier`` in a temporary directory and a
``TierWorker`` with a ``BlockMover`` that carries out the planner's orders.

The model of the forward pass: a full block of rank ``r`` holds
``expected(key, r)`` when it was computed while every earlier block of its
request held the right bytes on *every* rank (tensor parallelism mixes all
ranks), else garbage. Disk files disappear or rot on one rank behind the
planner's back, and the workers' disk tiers evict by size, so loads fail on
one rank only; vLLM reports the union and recomputes from the first failed
block, as modelled here.

Checked after every step: the planner's invariants; its host mirror equals
what each worker holds (after the drops it has yet to send), but for the prefetches
that failed on that rank (a damaged file, or one its disk tier evicted before the
read: the planner learns of those only when a load fails); every byte in any
host or disk tier is the right KV for its key (so nothing computed on top of a
failed load, nor anything from before a reset, is ever kept); every block vLLM
counts as computed holds the right KV on every rank; every advertised hit is
loadable when advertised, and its host hits are exactly the blocks every worker's
host tier holds then (a block another admission of the step promotes is not one
yet); only loads of damaged disk files, or of keys whose prefetch failed, ever fail.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbackend.ops import BlockMover
from kvbackend.store import CacheIdentity, DiskTier, HostTier, compute_block_keys
from kvbackend.vllm.tiers.messages import ScheduledRequest, Source
from kvbackend.vllm.tiers.planner import TierPlanner
from kvbackend.vllm.tiers.worker import TierWorker
from tests.store_helpers import damage_file

BS = 4  # tokens per block
ROW = 64  # bytes of one block over all layers
NUM_BLOCKS = 48  # device blocks (the same ids on both ranks, as under TP)
HOST_BLOCKS = 5
PREFETCH_BLOCKS = 3  # per step
DISK_BLOCKS = 12  # per rank; the workers' disk tiers evict beyond it
MAX_REQUESTS = 5
_rng = random.Random(3)
DOCS = [[_rng.randrange(3, 60) for _ in range(40)] for _ in range(3)]
IDENTITY = CacheIdentity(model_fingerprint="sim-weights", kv_dtype="uint8", block_size=BS,
                         kv_layout="sim", tp_rank=0, tp_size=2)
GARBAGE = np.zeros(ROW, dtype=np.uint8)


@functools.cache
def expected(key: str, rank: int) -> np.ndarray:
    """The KV of block ``key`` on ``rank``: bytes no other key or rank shares."""
    digest = hashlib.sha256(f"{key}/{rank}".encode()).digest()
    return np.frombuffer(digest * (ROW // len(digest)), dtype=np.uint8)


@dataclass
class SimRequest:
    request_id: str
    tokens: list[int]  # the planner holds this very list, as it holds vLLM's
    target: int  # the request finishes when it has this many tokens
    running: bool = False
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    partial_ok: bool = True  # its partial tail block was computed on the right KV


class Rank:
    """One tensor-parallel worker: KV tensor, host and disk tiers, its TierWorker. A tier
    block holds one ``ROW`` per KV-cache group (``groups``), but for ``state_groups``
    in an ordinary copy."""

    def __init__(self, rank: int, root: str, groups: int = 1, num_blocks: int = NUM_BLOCKS,
                 state_groups: tuple[int, ...] = ()) -> None:
        self.rank = rank
        identity = replace(IDENTITY, tp_rank=rank)
        self.cache = torch.zeros(num_blocks, ROW, dtype=torch.uint8)
        self.host = HostTier(HOST_BLOCKS * ROW * groups)
        self.disk = DiskTier(root, DISK_BLOCKS * (128 + ROW * groups), identity, durable=False,
                             rescan_interval_s=None)
        self.worker = TierWorker(BlockMover([self.cache], 0, ROW * groups, BS, self.host,
                                            self.disk, state_groups))
        self.reader = DiskTier(root, 1 << 30, identity, read_only=True, rescan_interval_s=None)
        self.checked: dict[str, tuple[int, int]] = {}  # path -> (mtime_ns, size) found right

    def holds(self, block_id: int, key: str) -> bool:
        return bool(np.array_equal(self.cache[block_id].numpy(), expected(key, self.rank)))

    def write(self, block_id: int, payload: np.ndarray) -> None:
        self.cache[block_id] = torch.from_numpy(payload.copy())

    def file_paths(self) -> list[str]:
        return sorted(os.path.join(d, f) for d, _, files in os.walk(self.disk.base)
                      for f in files if f.endswith(".kvb"))

    def file_keys(self) -> set[str]:
        return {os.path.basename(p)[:-4] for p in self.file_paths()}


class TierPlannerMachine(RuleBasedStateMachine):
    GROUPS = 1  # KV-cache groups: a tier block's physical blocks (hooks below)
    STATE_GROUPS: tuple[int, ...] = ()
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="kvb-planner-")
        self.ranks = [Rank(r, self.root, self.GROUPS, self.NUM_BLOCKS, self.STATE_GROUPS)
                      for r in range(IDENTITY.tp_size)]
        probes = [DiskTier(self.root, 1 << 30, replace(IDENTITY, tp_rank=r), read_only=True,
                           rescan_interval_s=None) for r in range(IDENTITY.tp_size)]
        self.now = 0.0  # the retention clock: one second per step
        pages = HOST_BLOCKS * self.GROUPS  # the host tier's ROWs: a payload takes 1 per group
        self.planner = TierPlanner(BS, IDENTITY.digest(), pages,
                                   lambda key: all(p.contains(key) for p in probes),
                                   max_retained=pages - 2 * self.GROUPS,
                                   clock=lambda: self.now,
                                   prefetch_step_blocks=PREFETCH_BLOCKS,
                                   state_groups=self.STATE_GROUPS,
                                   payload_weights=(self.GROUPS - len(self.STATE_GROUPS),
                                                    self.GROUPS))
        self.free = list(range(self.NUM_BLOCKS))
        self.requests: dict[str, SimRequest] = {}
        self.count = 0
        self.tampered: set[tuple[int, str]] = set()  # (rank, key) of files we damaged
        self.old_keys: set[str] = set()  # keys of the weights before the last reset
        self.steps_since_reset = 0
        # Per rank: keys the mirror lists whose prefetch failed there.
        self.unprefetched: list[set[str]] = [set() for _ in self.ranks]

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ---------------------------------------------------------------- helpers
    def keys(self, tokens: list[int], num_blocks: int) -> list[str]:
        return compute_block_keys(tokens[: num_blocks * BS], BS, self.planner.key_digest, b"")

    def release(self, request: SimRequest) -> None:
        self.free.extend(request.block_ids)
        request.block_ids, request.running, request.num_computed = [], False, 0

    # Hooks for models with several KV-cache groups (a subclass): one group here.
    def allocate(self, request: SimRequest, need: int) -> bool:
        """Give ``request`` blocks for ``need`` blocks of tokens, or return False."""
        if len(self.free) < need:
            return False
        request.block_ids = [self.free.pop() for _ in range(need)]
        return True

    def physical(self, request: SimRequest) -> list[tuple[int, ...]]:
        return []

    def adoptions(self, hit_blocks: int):
        """How many blocks of a hit vLLM may adopt (a strategy)."""
        return st.integers(0, hit_blocks)

    def loaded_keys(self, hit_keys: list[str]) -> list[str]:
        """The keys the loads of a hit of ``hit_keys`` read."""
        return hit_keys

    def device_hit_written(self, request: SimRequest, keys: list[str], device_hit: int) -> None:
        """The device cache shared ``device_hit`` tokens: the right KV."""
        for i in range(device_hit // BS):
            for r in self.ranks:
                r.write(request.block_ids[i], expected(keys[i], r.rank))
        request.partial_ok = True  # a partial device block is copied, right too

    def recompute_from(self, failed_blocks: list[int]) -> int:
        """The tokens vLLM keeps computed when blocks ``failed_blocks`` failed to load."""
        return failed_blocks[0] * BS

    def payload_is_right(self, key: str, rank: int, payload: np.ndarray) -> bool:
        return bool(np.array_equal(payload, expected(key, rank)))

    def finish(self, request: SimRequest, data) -> None:
        self.release(request)
        del self.requests[request.request_id]
        retain_s = data.draw(st.sampled_from([0, 0, 2, 6]), label="kv_retain_s")
        self.planner.request_finished(request.request_id, retain_s)

    def admit(self, request: SimRequest, device_hit: int, data) -> bool:
        """vLLM's admission: lookup, allocation (may fail), ``allocated``."""
        n = len(request.tokens)
        hit = self.planner.lookup(request.request_id, request.tokens, b"", device_hit)
        start, keys = device_hit // BS, self.keys(request.tokens, (n - 1) // BS)
        clear, drops = self.planner.pending_host_changes()
        loaded = self.loaded_keys(keys[start: start + hit // BS])
        in_host = [not clear and key not in drops and all(  # before the loads run
            r.host.contains(key) or key in self.unprefetched[r.rank] for r in self.ranks)
            for key in loaded]
        for r in self.ranks:  # every advertised hit is loadable, or known not to be
            files = r.file_keys()
            for key, held in zip(loaded, in_host):
                assert (held and r.host.contains(key) or key in files
                        or key in self.unprefetched[r.rank]), (
                    f"advertised block {key[:12]} is in no tier of rank {r.rank}")
        adopted = data.draw(self.adoptions(hit // BS), label="blocks adopted") * BS
        if not self.allocate(request, -(-request.target // BS)):
            return False  # cannot allocate: stays waiting, its lookup unused
        self.device_hit_written(request, keys, device_hit)
        self.planner.allocated(request.request_id, request.block_ids, adopted,
                               self.physical(request))
        self.planner.check_invariants()  # mid-step too: host hits are held by every worker
        host_hits = self.planner.hit_sources(request.request_id, adopted).get(Source.HOST, 0)
        assert host_hits == BS * sum(in_host[: adopted // BS]), (
            "the host hits are not the adopted blocks every worker's host tier holds")
        request.running, request.num_computed = True, device_hit + adopted
        return True

    def compute(self, request: SimRequest, begin: int, end: int, inputs_ok: bool = True) -> None:
        """The forward pass over tokens [begin, end) of ``request``, on every rank (with
        ``inputs_ok`` False, on inputs other than its KV that are wrong)."""
        keys = self.keys(request.tokens, -(-end // BS))
        ids = request.block_ids
        prefix_ok = inputs_ok and all(r.holds(ids[j], keys[j]) for j in range(begin // BS)
                                      for r in self.ranks)
        for i in range(begin // BS, -(-end // BS)):
            ok = prefix_ok = prefix_ok and (request.partial_ok if begin > i * BS else True)
            if (i + 1) * BS <= end:
                for r in self.ranks:
                    r.write(ids[i], expected(keys[i], r.rank) if ok else GARBAGE)
            else:
                request.partial_ok = ok
                for r in self.ranks:
                    r.write(ids[i], GARBAGE)

    # ------------------------------------------------------------------ rules
    @rule(data=st.data())
    def step(self, data) -> None:
        """One scheduler step: new requests, maybe a damaged file and a preemption,
        admissions, chunks, the workers' run, the failure report and vLLM's reaction."""
        arrival_files = [r.file_keys() for r in self.ranks]  # what a prefetch probes
        for _ in range(data.draw(st.integers(0, MAX_REQUESTS - len(self.requests)), label="new")):
            self.count += 1
            length = data.draw(st.integers(1, len(DOCS[0])), label="prompt length")
            tokens = DOCS[data.draw(st.integers(0, len(DOCS) - 1), label="doc")][:length]
            target = length + data.draw(st.integers(1, 6), label="output length")
            self.requests[f"r{self.count}"] = SimRequest(f"r{self.count}", tokens, target)
            if data.draw(st.booleans(), label="prefetched"):
                self.planner.prefetch(f"r{self.count}", tokens, b"")
        if data.draw(st.integers(0, 3), label="damage a file") == 0:
            self.damage_disk_file(data.draw(st.integers(0, 1), label="rank"),
                                  data.draw(st.integers(0, 1 << 20), label="file"),
                                  data.draw(st.booleans(), label="rot"))
        running = sorted(r for r, q in self.requests.items() if q.running)
        if running and data.draw(st.booleans(), label="preempt"):
            self.release(self.requests[data.draw(st.sampled_from(running), label="victim")])
        self.steps_since_reset += 1
        self.now += 1
        waiting = sorted(r for r, q in self.requests.items() if not q.running)
        for rid in data.draw(st.lists(st.sampled_from(waiting), unique=True, max_size=2)
                             if waiting else st.just([]), label="admitted"):
            request = self.requests[rid]
            device_hit = min(len(request.tokens) - 1, data.draw(
                st.integers(0, 3).map(lambda b: b * BS) | st.integers(0, 40), label="device hit"))
            if self.STATE_GROUPS:  # a hybrid's device hit ends on a block boundary
                device_hit -= device_hit % BS
            if not self.admit(request, device_hit, data):
                break
        scheduled = []
        for rid in sorted(r for r, q in self.requests.items() if q.running):
            request = self.requests[rid]
            left = len(request.tokens) - request.num_computed
            chunk = data.draw(st.integers(1, left), label=f"{rid} chunk")
            scheduled.append((request, request.num_computed, chunk))
        orders = self.planner.plan_step([
            ScheduledRequest(q.request_id, before, chunk, q.block_ids, self.physical(q))
            for q, before, chunk in scheduled])
        assert not orders.failed
        if self.old_keys:
            assert not any(o.to_disk for o in orders.saves), "disk write after a reset"
            assert not {o.key for o in orders.loads} & self.old_keys, "old KV loaded"
        for r in self.ranks:
            r.worker.start_step(orders)
        for request, before, chunk in scheduled:
            self.compute(request, before, before + chunk)
            request.num_computed = before + chunk
        for r in self.ranks:
            r.worker.finish_step(orders)
            self.check_prefetches(r, [k for k, _ in orders.prefetches], arrival_files[r.rank])
        failed = set().union(*(r.worker.take_load_errors() for r in self.ranks))
        loaded = {o.block_id: o.key for o in orders.loads}
        for block_id in failed:  # only a damaged disk file or a failed prefetch explains it
            key = loaded[block_id]
            assert any((r.rank, key) in self.tampered or key in self.unprefetched[r.rank]
                       for r in self.ranks), (
                f"loading block {block_id} failed, and no rank's file of it was damaged")
        self.planner.step_finished(failed)
        mirror = set(self.planner.host.keys())
        for r in self.ranks:  # forget the keys the mirror dropped or the rank holds now
            self.unprefetched[r.rank] = {k for k in self.unprefetched[r.rank]
                                         if k in mirror and not r.host.contains(k)}
        for request, before, chunk in scheduled:  # vLLM: recompute from the first failure
            bad = [i for i in range(-(-before // BS)) if request.block_ids[i] in failed]
            if bad:
                request.num_computed = self.recompute_from(bad)
            elif request.num_computed == len(request.tokens):
                if len(request.tokens) == request.target:
                    self.finish(request, data)
                else:
                    request.tokens.append(3 + len(request.tokens) % 50)

    def check_prefetches(self, rank: Rank, keys: list[str], probed: set[str]) -> None:
        """A prefetch fails on ``rank`` only for a damaged file, or one its disk held when
        the request arrived (``probed``) and evicted since."""
        files = rank.file_keys()
        for key in keys:
            if not rank.host.contains(key):
                assert (rank.rank, key) in self.tampered or key in probed - files, (
                    f"prefetching {key[:12]} failed on rank {rank.rank}, and its file was "
                    "neither damaged nor evicted")
                self.unprefetched[rank.rank].add(key)

    @precondition(lambda self: len(self.requests) >= 3)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)), label="aborted")
        self.finish(self.requests[rid], data)

    def damage_disk_file(self, rank: int, pick: int, rot: bool) -> None:
        """Another process evicts a file (or it rots) on one rank only."""
        paths = self.ranks[rank].file_paths()
        if not paths:
            return
        path = paths[pick % len(paths)]
        self.tampered.add((rank, os.path.basename(path)[:-4]))
        damage_file(path, rot)

    @precondition(lambda self: self.steps_since_reset >= 12)
    @rule()
    def reset_after_weight_update(self) -> None:
        """``reset_prefix_cache(reset_running_requests=True, reset_connector=True)``:
        the running requests are preempted, then the connector is reset."""
        for request in self.requests.values():
            if request.running:
                self.release(request)
        for r in self.ranks:
            self.old_keys.update(r.host.keys_lru())
            self.old_keys.update(r.file_keys())
        self.planner.reset()
        self.steps_since_reset = 0
        self.unprefetched = [set() for _ in self.ranks]

    # ------------------------------------------------------------- invariants
    @invariant()
    def planner_is_consistent(self) -> None:
        self.planner.check_invariants()

    @invariant()
    def mirror_equals_what_every_worker_holds(self) -> None:
        mirror = set(self.planner.host.keys())
        clear, drops = self.planner.pending_host_changes()
        for r in self.ranks:
            held = set() if clear else set(r.host.keys_lru()) - set(drops)
            lacks = mirror - held - self.unprefetched[r.rank]
            assert held <= mirror and not lacks, (
                f"rank {r.rank} holds {sorted(held - mirror)[:2]} beyond the mirror, lacks "
                f"{sorted(lacks)[:2]}")

    @invariant()
    def every_stored_block_is_the_right_kv(self) -> None:
        for r in self.ranks:
            for key in r.host.keys_lru():
                assert self.payload_is_right(key, r.rank, r.host.get(key)), (
                    f"rank {r.rank} host tier holds wrong KV for {key[:12]}")
            for path in r.file_paths():
                stat = os.stat(path)
                if r.checked.get(path) == (stat.st_mtime_ns, stat.st_size):
                    continue  # read and found right before, unchanged since
                key = os.path.basename(path)[:-4]
                payload = r.reader.get(key)
                if payload is None:
                    assert (r.rank, key) in self.tampered, f"unreadable file {path}"
                    continue
                assert self.payload_is_right(key, r.rank, np.frombuffer(payload, np.uint8)), (
                    f"rank {r.rank} disk tier holds wrong KV for {key[:12]}")
                r.checked[path] = (stat.st_mtime_ns, stat.st_size)

    @invariant()
    def computed_blocks_hold_the_right_kv(self) -> None:
        for request in self.requests.values():
            if not request.running:
                continue
            num_full = request.num_computed // BS
            keys = self.keys(request.tokens, num_full)
            for i in range(num_full):
                for r in self.ranks:
                    assert r.holds(request.block_ids[i], keys[i]), (
                        f"{request.request_id} block {i} counts as computed but holds "
                        f"wrong KV on rank {r.rank}")


TierPlannerMachine.TestCase.settings = settings(TierPlannerMachine.TestCase.settings,
                                                stateful_step_count=30)
TestTierPlanner = TierPlannerMachine.TestCase
