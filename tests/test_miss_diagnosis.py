"""Property tests of the miss diagnosis: the bounded memory of published prefixes
against a model, and ``diagnose`` on a real PrefixCache after random traffic."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvbackend.core import PrefixCache
from kvbackend.core.miss_diagnosis import (
    BLOCK_ALIGNMENT, DIVERGED, DRAFT_LOOKAHEAD, EVICTED, FINAL_TOKEN, NEVER_SEEN,
    NO_STATE_CHECKPOINT, OTHER_NAMESPACE, REASONS, Admission, diagnose,
)
from kvbackend.core.seen_prefixes import PrefixDigests, SeenPrefixes

BS = 4
NAMESPACES = st.sampled_from([None, "tenant-a", ("lora", 7)])
PROMPTS = st.lists(st.sampled_from([0, 1, 2, 2**62 + 7]), min_size=1, max_size=22)


class SeenPrefixesMachine(RuleBasedStateMachine):
    """SeenPrefixes == the ``capacity`` most recently added distinct digests."""

    def __init__(self):
        super().__init__()
        self.seen = SeenPrefixes(5)
        self.model: list[int] = []  # oldest first

    @rule(digest=st.integers(0, 12) | st.integers(0, 2**64 - 1))
    def add(self, digest):
        self.seen.add(digest)
        if digest in self.model:
            self.model.remove(digest)
        self.model = (self.model + [digest])[-5:]

    @rule()
    def clear(self):
        self.seen.clear()
        self.model = []

    @rule(digest=st.integers(0, 12))
    def contains(self, digest):
        assert (digest in self.seen) == (digest in self.model)

    @invariant()
    def consistent(self):
        self.seen.check_invariants()
        assert len(self.seen) == len(self.model)


TestSeenPrefixes = SeenPrefixesMachine.TestCase
TestSeenPrefixes.settings = settings(stateful_step_count=20)


@given(tokens=PROMPTS, cuts=st.lists(st.integers(1, 22), max_size=4), m=st.integers(1, 22))
def test_a_prefix_digest_does_not_depend_on_how_it_was_extended(tokens, cuts, m):
    tokens = np.asarray(tokens, dtype=np.int64)
    m = min(m, len(tokens))
    grown = PrefixDigests(None, BS)
    for cut in cuts:
        grown.extend(tokens, min(cut, len(tokens)))
    fresh = PrefixDigests(None, BS)
    assert grown.digest(tokens, m) == fresh.digest(tokens[:m].copy(), m)
    common = min(len(grown.boundaries), len(fresh.boundaries))
    assert grown.boundaries[:common] == fresh.boundaries[:common]


class DiagnosisMachine(RuleBasedStateMachine):
    """Random traffic (served prompts, evictions) through a real PrefixCache; every
    diagnosis tiles the lost tokens and each span's reason is true of the tree."""

    def __init__(self):
        super().__init__()
        self.cache = PrefixCache(12, BS)
        self.seen = SeenPrefixes(1 << 12)

    def publish(self, tokens, namespace):
        digests = PrefixDigests(namespace, BS)
        digests.extend(tokens, len(tokens))
        for digest in digests.boundaries:
            self.seen.add(digest)
        self.seen.add(digests.digest(tokens, len(tokens)))

    @rule(prompt=PROMPTS, namespace=NAMESPACES)
    def serve(self, prompt, namespace):
        tokens = np.asarray(prompt, dtype=np.int64)
        match = self.cache.match(tokens, namespace)
        seq = self.cache.open_sequence(match, len(tokens))
        if seq is None:
            return
        self.cache.cache(seq, tokens)
        self.publish(tokens, namespace)
        self.cache.release(seq)

    @rule(num_blocks=st.integers(1, 6))
    def evict(self, num_blocks):
        self.cache.evict(num_blocks)

    @rule(prompt=PROMPTS, namespace=NAMESPACES, cut=st.integers(0, 5), tier=st.integers(0, 3),
          same_step=st.booleans(), state=st.booleans(), lookahead=st.integers(0, 2))
    def explain(self, prompt, namespace, cut, tier, same_step, state, lookahead):
        """``state``: a hybrid's admission (whole blocks, no tiers, no same-step cut);
        ``lookahead``: an EAGLE / MTP drafter's, whose hit ends that many tokens before
        the tree's match of the request's tokens (none with ``state``)."""
        tokens = np.asarray(prompt, dtype=np.int64)
        tree, n = self.cache.tree, len(tokens)
        lookahead = 0 if state else lookahead
        longest, _ = tree.lookup(tokens[: n - 1], namespace, touch=False)
        extended, _ = tree.lookup(tokens[: n - 1 + lookahead], namespace, touch=False)
        device = max(0, min(longest, extended - lookahead) - cut)
        tier_hit = min(tier * BS, n - 1 - device) if device % BS == 0 else 0
        if state:
            device, tier_hit, same_step = device - device % BS, 0, False
        admission = Admission(n - 1, device, tier_hit, same_step_cut=same_step,
                              state_checkpoints=state, draft_lookahead=lookahead)
        spans = diagnose(tree, self.seen, PrefixDigests(namespace, BS), tokens, namespace,
                         admission)
        pos = device + tier_hit
        for span in spans:
            assert span.reason in REASONS and span.start == pos < span.end
            pos = span.end
            if span.reason == FINAL_TOKEN:
                assert span.end == n
            if span.reason == DRAFT_LOOKAHEAD:  # the tree's last tokens, nothing after
                assert lookahead and span.end == longest
                assert span.start >= extended - lookahead
            if span.reason == NO_STATE_CHECKPOINT:  # whole blocks the tree holds
                assert state and span.end % BS == 0 and span.end <= longest
            if state and span.reason == BLOCK_ALIGNMENT:  # only the partial block after
                assert span.end == longest and span.end - span.start < BS
            if span.reason in (NEVER_SEEN, EVICTED, DIVERGED):
                assert longest <= span.start, "the tree holds what was called missing"
            if span.reason == DIVERGED:
                assert span.detail["position"] == longest == span.start
                assert span.detail["cached"][:1] != span.detail["request"][:1]
            if span.reason == OTHER_NAMESPACE:
                other = span.detail["namespace"]
                assert other != namespace
                assert tree.lookup(tokens[: n - 1], other, touch=False)[0] >= span.end
            if span.reason == NEVER_SEEN:
                for other in tree.namespaces():
                    held = tree.lookup(tokens[: n - 1], other, touch=False)[0]
                    assert held < span.start + BS, "another namespace held a block of it"
        assert pos == n

    @invariant()
    def consistent(self):
        self.cache.tree.check_invariants()
        self.seen.check_invariants()


TestDiagnosis = DiagnosisMachine.TestCase
TestDiagnosis.settings = settings(max_examples=min(settings().max_examples, 100),
                                  stateful_step_count=20)  # ~20 s at the ci profile
