"""Per-request kvbackend options in ``SamplingParams.extra_args``: one parser, two users.

``kv_priority`` (an int, default 0), ``kv_pin`` (a bool, default false) and
``kv_retain_s`` (seconds, a finite number >= 0, default 0: after the request ends,
its whole context stays ahead of ordinary entries that long) steer eviction. They
arrive offline as ``SamplingParams(extra_args={...})`` and through the OpenAI server
as ``vllm_xargs``, whose values are only str/int/float (JSON ``true`` arrives as
``1``), so ``kv_pin`` also accepts 0/1 and "true"/"false".

``parse_request_options`` is the only place that knows these rules. It is run
twice per request (the engine core's users read it through ``request_options``):

  * in the API process, by :class:`KVOptionsValidator`, a no-op logits processor
    whose ``validate_params`` hook vLLM runs on every request at admission; a bad
    value fails that request (HTTP 400 from the server, an exception from
    ``LLM.generate``) with a message naming the option;
  * in the engine core, by the manager (and, at a request's end, the tier
    connector), which must never raise into the step loop and fall back to the
    defaults (with a warning) for a request that bypassed the API process.

``engine_kwargs`` (and ``--kv-backend``) register the validator through vLLM's
``logits_processors`` engine argument (``kvbackend.vllm.OPTIONS_VALIDATOR``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsProcessor as LogitsProcessorV2,
)

if TYPE_CHECKING:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

logger = logging.getLogger("kvbackend")

PRIORITY_OPTION = "kv_priority"
PIN_OPTION = "kv_pin"
RETAIN_OPTION = "kv_retain_s"

# True == 1 and False == 0 hash alike, so these entries also accept 0 and 1.
_PIN_VALUES = {True: True, False: False, "true": True, "false": False}


class RequestOptionError(ValueError):
    """A kvbackend per-request option has a bad value; ``option`` names it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """A request's retention hints: evict lower ``priority`` first; never evict a pinned
    prompt; keep the whole context ahead of ordinary entries ``retain_s`` seconds after
    the request ends."""

    priority: int = 0
    pin: bool = False
    retain_s: float = 0.0


DEFAULT_OPTIONS = RequestOptions()


def parse_request_options(extra_args: Mapping[str, Any] | None) -> RequestOptions:
    """The kvbackend options in ``extra_args`` (other keys are left alone). O(1).

    Raises :class:`RequestOptionError` (a ``ValueError``) naming the first bad option.
    """
    if not extra_args:
        return DEFAULT_OPTIONS
    priority = extra_args.get(PRIORITY_OPTION, 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestOptionError(PRIORITY_OPTION, f"{PRIORITY_OPTION} must be an integer, "
                                                  f"got {priority!r}")
    pin = extra_args.get(PIN_OPTION, False)
    key = pin.lower() if isinstance(pin, str) else pin
    flag = _PIN_VALUES.get(key) if isinstance(key, (bool, int, str)) else None
    if flag is None:
        raise RequestOptionError(PIN_OPTION, f"{PIN_OPTION} must be a boolean (true/false, "
                                             f"1/0), got {pin!r}")
    retain_s = extra_args.get(RETAIN_OPTION, 0.0)
    if (isinstance(retain_s, bool) or not isinstance(retain_s, (int, float))
            or not 0 <= retain_s < math.inf):
        raise RequestOptionError(RETAIN_OPTION, f"{RETAIN_OPTION} must be a finite number of "
                                                f"seconds >= 0, got {retain_s!r}")
    return RequestOptions(priority=priority, pin=flag, retain_s=float(retain_s))


def request_options(request: Request) -> RequestOptions:
    """The engine core's reading of ``request``'s options: the defaults, with a warning,
    when bad (the API process rejects bad values; this only sees requests that
    bypassed it). O(1)."""
    params = request.sampling_params
    try:
        return parse_request_options(params.extra_args if params is not None else None)
    except RequestOptionError as e:
        logger.warning("kvbackend: request %s: %s; using the defaults", request.request_id, e)
        return DEFAULT_OPTIONS


class KVOptionsValidator(LogitsProcessor, LogitsProcessorV2):
    """Checks the kvbackend options of each request in the API process; leaves logits alone.

    vLLM calls ``validate_params`` at admission (``InputProcessor``) and turns its
    ``ValueError`` into a validation error: HTTP 400 from the OpenAI server. Both
    logits-processor interfaces are implemented (model runner V1, used by the CPU
    build, and V2), so the same class serves either runner. Per step it costs one
    call that returns the logits unchanged (V1 calls it only for sampled batches).
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        from vllm.exceptions import VLLMValidationError

        try:
            parse_request_options(sampling_params.extra_args)
        except RequestOptionError as e:
            raise VLLMValidationError(str(e), parameter=e.option) from None

    def __init__(self, vllm_config: Any, *runner_state: Any) -> None:
        pass  # stateless: (vllm_config, device, is_pin_memory) on V1, (vllm_config, state) on V2

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return False  # V2: modifies no request's logits


__all__ = ["DEFAULT_OPTIONS", "KVOptionsValidator", "PIN_OPTION", "PRIORITY_OPTION",
           "RETAIN_OPTION", "RequestOptionError", "RequestOptions", "parse_request_options",
           "request_options"]
