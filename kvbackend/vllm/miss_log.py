"""``explain_misses``: one JSON line per request, saying why prompt tokens were not reused.

The manager calls these, each behind one ``if manager.miss_log is not None``:

    admitted(id, namespace, prompt, admission)  first admission, before the request's
                                                own blocks change the tree: diagnose
    write(id, tier_sources)                     once vLLM knows which tier supplied
                                                the tier hit: append the record
    published(id, namespace, tokens)            tokens handed to the tree: remember them
    forget(id) / cleared()                      request freed / cache reset

A record (``kvbackend explain FILE`` summarises a file of them)::

    {"time": 1764770000.1, "request_id": "cmpl-...", "namespace": "default",
     "prompt_tokens": 640, "reused_tokens": 600, "reused": {"device": 576, "host": 24},
     "lost_tokens": 40, "lost": [{"reason": "diverged", "start": 600, "end": 639,
     "tokens": 39, "position": 600, "before": [...], "request": [...], "cached": [...]},
     {"reason": "final_token", "start": 639, "end": 640, "tokens": 1}]}

``namespace`` is ``"default"`` or ``"ns-"`` and 16 hex digits of a BLAKE2b digest of
the namespace (salt, adapter): an opaque id, never the salt. The file holds prompt
token ids: it is created 0600. Lines are appended with one ``write`` each on an
``O_APPEND`` descriptor, so several processes can share a file. Nothing here
raises into the engine's step loop: the first error is logged and the log stops.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvbackend.core.miss_diagnosis import Admission, LostSpan
from kvbackend.core.prefix_cache import PrefixCache
from kvbackend.core.seen_prefixes import PrefixDigests, SeenPrefixes
from kvbackend.vllm.config import open_for_append
from kvbackend.vllm.namespace import namespace_bytes
from kvbackend.vllm.step_writes import StepWrites

logger = logging.getLogger(__name__)

SEEN_CAPACITY = 1 << 16  # remembered prefix digests (~8 MiB): 1M tokens at block 16


@dataclass(slots=True)
class _Request:
    digests: PrefixDigests
    num_remembered: int = 0  # block boundaries of it added to the seen set
    pending: tuple[int, Admission, list[LostSpan]] | None = None  # diagnosed, not written
    namespace_id: str = "default"


def _tier_name(source: Any) -> str:
    """``host`` / ``disk`` / ``remote`` for a vLLM ``CacheHitSource`` (kvbackend's
    connector reports its remote tier as ``external_unspecified``) or a name."""
    name = getattr(source, "value", source)
    return "remote" if name == "external_unspecified" else str(name)


def namespace_id(namespace: Hashable) -> str:
    """An opaque, stable id of a namespace (never the salt itself)."""
    if namespace is None:
        return "default"
    return "ns-" + hashlib.blake2b(namespace_bytes(namespace), digest_size=8).hexdigest()


class MissLog:
    """Diagnoses each admitted request against ``cache`` and appends its record to ``path``."""

    def __init__(self, path: str, cache: PrefixCache, seen_capacity: int = SEEN_CAPACITY) -> None:
        self.path = path
        self.cache = cache
        self.seen = SeenPrefixes(seen_capacity)
        self._fd: int | None = open_for_append(path)
        self._requests: dict[str, _Request] = {}

    def admitted(self, request_id: str, namespace: Hashable, prompt: np.ndarray,
                 admission: Admission, written: StepWrites | None = None) -> None:
        """Diagnose an admission. ``written``: device blocks written in this step (a device
        hit ending inside one of them, on a slot the step writes, was cut back:
        ``same_step_cut``)."""
        if self._fd is None:
            return
        try:
            longest = self.cache.match(prompt, namespace, max_tokens=admission.limit,
                                       touch=False)
            if written is not None and longest.num_partial_tokens and written.overwrites(
                    longest.partial_block_id, longest.num_partial_tokens):
                admission = replace(admission, same_step_cut=True)
            state = self._state(request_id, namespace)
            spans = self.cache.diagnose_miss(self.seen, state.digests, prompt, namespace, admission)
            state.pending = (len(prompt), admission, spans)
        except Exception:  # noqa: BLE001 - diagnostics must never fail the scheduler
            self._stop("diagnosing a request failed")

    def write(self, request_id: str, tier_sources: Callable[[int], Mapping[Any, int]]) -> None:
        """Append the pending record of ``request_id``. ``tier_sources(n)``: the tokens
        per tier of its ``n``-token tier hit (vLLM's ``CacheHitSource`` or names)."""
        state = self._requests.get(request_id)
        if self._fd is None or state is None or state.pending is None:
            return
        num_prompt, admission, spans = state.pending
        state.pending = None
        try:
            reused = {"device": admission.device_hit}
            if admission.tier_hit:
                sources = {_tier_name(s): n for s, n in tier_sources(admission.tier_hit).items()}
                known = sum(sources.values()) == admission.tier_hit
                reused.update(sources if known else {"tiers": admission.tier_hit})
            record = {
                "time": round(time.time(), 3), "request_id": request_id,
                "namespace": state.namespace_id, "prompt_tokens": num_prompt,
                "reused_tokens": admission.device_hit + admission.tier_hit, "reused": reused,
                "lost_tokens": sum(s.end - s.start for s in spans),
                "lost": [self._span(s) for s in spans],
            }
            os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        except Exception:  # noqa: BLE001
            self._stop(f"writing a record to {self.path} failed")

    def published(self, request_id: str, namespace: Hashable, tokens: np.ndarray) -> None:
        """Remember every block boundary of ``tokens`` (and its end) as once cached."""
        if self._fd is None:
            return
        try:
            state = self._state(request_id, namespace)
            digests, seen = state.digests, self.seen
            digests.extend(tokens, len(tokens))
            for digest in digests.boundaries[state.num_remembered:]:
                seen.add(digest)
            state.num_remembered = len(digests.boundaries)
            if len(tokens) % digests.block_size:
                seen.add(digests.digest(tokens, len(tokens)))
        except Exception:  # noqa: BLE001
            self._stop("remembering published tokens failed")

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def cleared(self) -> None:
        """The cache was reset: nothing published before counts as evicted."""
        self.seen.clear()

    # -------------------------------------------------------------- helpers
    def _state(self, request_id: str, namespace: Hashable) -> _Request:
        state = self._requests.get(request_id)
        if state is None:
            digests = PrefixDigests(namespace, self.cache.block_size)
            state = self._requests[request_id] = _Request(digests,
                                                          namespace_id=namespace_id(namespace))
        return state

    def _span(self, span: LostSpan) -> dict:
        entry = {"reason": span.reason, "start": span.start, "end": span.end,
                 "tokens": span.end - span.start, **span.detail}
        if "namespace" in span.detail:
            entry["namespace"] = namespace_id(span.detail["namespace"])
        return entry

    def _stop(self, what: str) -> None:
        logger.exception("kvbackend explain_misses: %s; no more records are written to %s",
                         what, self.path)
        fd, self._fd = self._fd, None
        self._requests.clear()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
