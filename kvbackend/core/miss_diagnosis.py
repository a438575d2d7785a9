"""Why a request reused fewer cached tokens than its prompt holds (diagnostics only).

``diagnose`` splits the prompt's tokens that were not reused, ``[reused, prompt)``,
into consecutive ``LostSpan``s, each with one reason:

    same_step_block  the device tree holds them, but in a partial block written in
                     this very step (a copy would read unwritten KV)
    block_alignment  the device tree holds them, but the engine took whole blocks
                     only; or, after a tier hit, the partial block the tiers (which
                     store whole blocks) could not supply
    draft_lookahead  the device tree holds them, but a speculative drafter's KV there
                     (EAGLE / MTP) also read the next tokens, which the tree does not
                     hold for this request: its writer's next token may differ
    no_state_checkpoint  the device tree holds these whole blocks, but a recurrent
                     state (Mamba / linear-attention hybrids) resumes only from a
                     block that a step ended on, and none of them is one (or still
                     has the state pages it had then)
    evicted          published to the device tree once, gone since (``SeenPrefixes``)
    other_namespace  another namespace (cache salt / LoRA adapter) holds them, at
                     least a block's worth (a shared first token, e.g. BOS, is no news)
    diverged         the tree continues past ``position`` with other tokens: a
                     window of the request's and the cached tokens around it
    never_seen       nothing cached, evicted or in another namespace extends here
    final_token      the engine computes the last prompt token anyway (for logits)
    lookup_disabled  the request skipped the lookup (e.g. prompt logprobs)
    not_cacheable    multimodal or embedding prompts: token ids don't name them

It only reads the tree (``touch=False``): diagnosing never changes what is cached
or evicted. Complexity: O(depth + limit) for the match and the digests, plus one
match per other namespace whose root shares the first token (at most
``MAX_OTHER_NAMESPACES``; one dict lookup for each other namespace).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbackend.core.radix_node import RadixNode
from kvbackend.core.radix_tree import RadixTree
from kvbackend.core.seen_prefixes import PrefixDigests, SeenPrefixes

SAME_STEP_BLOCK = "same_step_block"
BLOCK_ALIGNMENT = "block_alignment"
DRAFT_LOOKAHEAD = "draft_lookahead"
NO_STATE_CHECKPOINT = "no_state_checkpoint"
EVICTED = "evicted"
OTHER_NAMESPACE = "other_namespace"
DIVERGED = "diverged"
NEVER_SEEN = "never_seen"
FINAL_TOKEN = "final_token"
LOOKUP_DISABLED = "lookup_disabled"
NOT_CACHEABLE = "not_cacheable"
REASONS = (SAME_STEP_BLOCK, BLOCK_ALIGNMENT, DRAFT_LOOKAHEAD, NO_STATE_CHECKPOINT, EVICTED,
           OTHER_NAMESPACE, DIVERGED, NEVER_SEEN, FINAL_TOKEN, LOOKUP_DISABLED, NOT_CACHEABLE)

WINDOW = 8  # tokens shown on each side of a divergence
MAX_OTHER_NAMESPACES = 64  # namespaces searched for the prompt, per request
_NOBODY = object()


@dataclass(frozen=True, slots=True)
class LostSpan:
    """Prompt positions ``[start, end)`` not reused, for ``reason``; ``detail`` holds
    reason-specific facts (a divergence window, the tier, the other namespace)."""

    reason: str
    start: int
    end: int
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Admission:
    """What the engine did with a request's prompt at admission.

    ``limit``: the most tokens the lookup could return (prompt - 1 on a first
    admission); ``device_hit``: tokens it took from the device tree;
    ``tier_hit``: tokens loaded from lower tiers right after them;
    ``same_step_cut``: the device hit was cut back because its partial block is
    written in this step; ``lookup``: False when the request skipped the lookup;
    ``cacheable``: False for prompts that token ids do not name;
    ``state_checkpoints``: the model keeps a recurrent state, so a device hit ends
    on a whole block holding a state checkpoint; ``draft_lookahead``: a drafter's KV
    at a position reads that many next tokens, so a device hit ends that many tokens
    before the tree's match of the request's tokens.
    """

    limit: int
    device_hit: int
    tier_hit: int = 0
    same_step_cut: bool = False
    lookup: bool = True
    cacheable: bool = True
    state_checkpoints: bool = False
    draft_lookahead: int = 0


def diagnose(tree: RadixTree, seen: SeenPrefixes, digests: PrefixDigests, prompt: np.ndarray,
             namespace: Hashable, admission: Admission) -> list[LostSpan]:
    """The spans, in order, that tile ``[device_hit + tier_hit, len(prompt))`` exactly.

    ``digests`` are the request's own (the same ``PrefixDigests`` later publishes
    its prefixes to ``seen``). See the module docstring for the reasons.
    """
    n, reused = len(prompt), admission.device_hit + admission.tier_hit
    if not admission.cacheable:
        return [LostSpan(NOT_CACHEABLE, reused, n)] if reused < n else []
    if not admission.lookup:
        return [LostSpan(LOOKUP_DISABLED, reused, n)] if reused < n else []
    limit = min(admission.limit, n)
    spans: list[LostSpan] = []
    longest, node = tree.lookup(prompt[:limit], namespace, touch=False)
    vouched = longest  # the tree also holds the next draft_lookahead tokens up to here
    if admission.draft_lookahead:
        extended, _ = tree.lookup(prompt[:limit + admission.draft_lookahead], namespace,
                                  touch=False)
        vouched = max(0, min(longest, extended - admission.draft_lookahead))
    pos = reused
    whole = vouched - vouched % tree.block_size
    if admission.state_checkpoints and whole > pos:  # whole blocks, none resumable
        spans.append(LostSpan(NO_STATE_CHECKPOINT, pos, whole, {"tier": "device"}))
        pos = whole
    if vouched > pos:  # the tree held more than the engine took
        reason = SAME_STEP_BLOCK if admission.same_step_cut else BLOCK_ALIGNMENT
        spans.append(LostSpan(reason, pos, vouched, {"tier": "device"}))
        pos = vouched
    if longest > pos:
        spans.append(LostSpan(DRAFT_LOOKAHEAD, pos, longest, {"tier": "device"}))
        pos = longest
    if pos < limit:
        pos = _evicted(spans, seen, digests, prompt, pos, limit, admission, tree.block_size)
    if pos < limit:
        pos = _other_namespace(spans, tree, prompt, namespace, pos, limit)
    if pos < limit and pos == longest and _diverges(node, longest):
        spans.append(LostSpan(DIVERGED, pos, limit, _window(prompt, node, longest)))
        pos = limit
    if pos < limit:
        spans.append(LostSpan(NEVER_SEEN, pos, limit))
    if max(limit, reused) < n:
        spans.append(LostSpan(FINAL_TOKEN, max(limit, reused), n))
    return spans


def _evicted(spans: list[LostSpan], seen: SeenPrefixes, digests: PrefixDigests,
             prompt: np.ndarray, pos: int, limit: int, admission: Admission,
             block_size: int) -> int:
    """Append the span up to the longest prefix once published and now gone; the
    whole prompt counts as one such prefix. Returns the new position."""
    n = len(prompt)
    if n > pos and digests.digest(prompt, n) in seen:
        end = limit
    else:
        digests.extend(prompt, limit)
        first = pos // block_size  # boundaries[i] is the digest of (i + 1) blocks
        last = limit // block_size
        end = next((b * block_size for b in range(last, first, -1)
                    if digests.boundaries[b - 1] in seen), pos)
    if end <= pos:
        return pos
    partial_after_tier = (admission.tier_hit and pos == admission.device_hit + admission.tier_hit
                          and end - pos < block_size)
    if partial_after_tier:  # the tiers served every whole block they could
        spans.append(LostSpan(BLOCK_ALIGNMENT, pos, end, {"tier": "tiers store whole blocks"}))
    else:
        spans.append(LostSpan(EVICTED, pos, end, {"tier": "device"}))
    return end


def _other_namespace(spans: list[LostSpan], tree: RadixTree, prompt: np.ndarray,
                     namespace: Hashable, pos: int, limit: int) -> int:
    """Append the span another namespace holds beyond ``pos``, if one does."""
    best, holder, searched = pos, _NOBODY, 0
    first = int(prompt[0])
    for other, root in tree.roots.items():
        if other == namespace or first not in root.children:
            continue
        matched, _ = tree.lookup(prompt[:limit], other, touch=False)
        if matched > best:
            best, holder = matched, other
        searched += 1
        if searched >= MAX_OTHER_NAMESPACES:
            break
    if holder is _NOBODY or best - pos < tree.block_size:  # (None: the default namespace)
        return pos
    spans.append(LostSpan(OTHER_NAMESPACE, pos, best, {"namespace": holder}))
    return best


def _diverges(node: RadixNode, position: int) -> bool:
    """Whether the cached path through ``node`` goes on past ``position`` (> 0)."""
    return position > 0 and (position < node.end or bool(node.children))


def _window(prompt: np.ndarray, node: RadixNode, position: int) -> dict[str, Any]:
    """The tokens around a divergence: before it (shared), then the request's and
    the cached path's (the most recently used branch). O(depth of WINDOW tokens)."""
    cached: list[int] = []
    offset = position - node.start
    while len(cached) < WINDOW:
        cached.extend(node.tokens[offset: offset + WINDOW - len(cached)].tolist())
        if not node.children:
            break
        node, offset = max(node.children.values(), key=lambda c: c.last_access), 0
    return {"position": position,
            "before": prompt[max(0, position - WINDOW): position].tolist(),
            "request": prompt[position: position + WINDOW].tolist(),
            "cached": cached}
