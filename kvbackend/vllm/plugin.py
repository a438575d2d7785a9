"""The ``vllm.general_plugins`` entry point: ``--kv-backend`` for ``vllm serve``.

vLLM loads general plugins in every process before it parses arguments, but
hands them no parser, and ``EngineArgs.from_cli_args`` copies only its own
dataclass fields. So the plugin wraps two ``EngineArgs`` methods: one adds the
flags, the other turns them into engine configuration (``scheduler_cls``,
``additional_config``, the per-request option validator in ``logits_processors``)
that travels to the engine-core process. Without ``--kv-backend`` both wrappers
change nothing. A third wrapper, around ``create_engine_config`` (offline and
server alike), drops that validator under speculative decoding, where vLLM's
workers refuse every custom logits processor: bad options then fall back to the
defaults in the engine core, with a warning, instead of failing the request; and
for a Mamba / linear-attention hybrid it builds the configuration again with
vLLM's prefix-caching switch on (its workers then keep state checkpoints).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvbackend.vllm import (
    OPTIONS_VALIDATOR, SCHEDULER_CLS, TIER_CONNECTOR, TIER_CONNECTOR_MODULE, engine_kwargs,
)
from kvbackend.vllm.config import ADDITIONAL_CONFIG_KEY, KVBackendConfig

BACKEND_NAMES = ("kvbackend",)
logger = logging.getLogger(__name__)


def register() -> None:
    """Install the CLI flags into vLLM's ``EngineArgs`` and route kvbackend's
    logs through vLLM's handlers; idempotent."""
    from vllm.engine.arg_utils import EngineArgs

    _share_vllm_log_handlers()
    _register_tier_connector()

    if getattr(EngineArgs, "_kvbackend_flags", False):
        return
    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__
    original_create = EngineArgs.create_engine_config

    def add_cli_args(parser, *args, **kwargs):
        parser = original_add(parser, *args, **kwargs)
        if "--kv-backend" not in parser._option_string_actions:
            add_flags(parser)
        return parser

    def from_cli_args(cls, args: argparse.Namespace):
        engine_args = original_from(cls, args)
        apply_flags(engine_args, getattr(args, "kv_backend", None),
                    getattr(args, "kv_backend_config", None))
        return engine_args

    def create_engine_config(self, *args, **kwargs):
        config = original_create(self, *args, **kwargs)
        if _needs_state_checkpoints(self, config):
            self.enable_prefix_caching = True
            config = original_create(self, *args, **kwargs)
        _drop_validator_under_spec_decode(config)
        return config

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
    EngineArgs._kvbackend_flags = True


def _needs_state_checkpoints(engine_args: Any, config: Any) -> bool:
    """Whether kvbackend, which switches vLLM's prefix caching off, must switch it back on
    for ``config``'s model: a Mamba / linear-attention hybrid. Only then do vLLM's
    workers keep the state at block boundaries (``mamba_cache_mode="align"``) that
    kvbackend's hits resume from; vLLM's hash-based lookups stay unused (kvbackend's
    manager replaces them)."""
    model = config.model_config
    return (engine_args.scheduler_cls == SCHEDULER_CLS and model is not None
            and not config.cache_config.enable_prefix_caching and model.is_hybrid)


def _drop_validator_under_spec_decode(config: Any) -> None:
    """vLLM's workers refuse custom logits processors with speculative decoding; take
    kvbackend's option validator out of ``config`` then (the user's own stay, and vLLM
    names them)."""
    model = config.model_config
    procs = model.logits_processors if model is not None else None
    if config.speculative_config is None or not procs or OPTIONS_VALIDATOR not in procs:
        return
    model.logits_processors = [p for p in procs if p != OPTIONS_VALIDATOR] or None
    logger.info("kvbackend: speculative decoding admits no logits processor, so bad "
                "kv_priority/kv_pin/kv_retain_s values fall back to the defaults")


def _register_tier_connector() -> None:
    """Name the tier connector in vLLM's connector registry: a ``MultiConnector`` rebuilds
    its children's stats by registered name (in the API process's stats logger)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(TIER_CONNECTOR, TIER_CONNECTOR_MODULE,
                                              TIER_CONNECTOR)
    except ValueError:  # registered already
        pass


def _share_vllm_log_handlers() -> None:
    """Give the ``kvbackend`` loggers vLLM's handlers and level, so their lines
    look like vLLM's and INFO lines are not dropped."""
    ours, theirs = logging.getLogger("kvbackend"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kvbackend", "Token-exact prefix KV cache (kvbackend)")
    group.add_argument("--kv-backend", choices=BACKEND_NAMES, default=None,
                       help="Serve the KV cache through this backend.")
    group.add_argument("--kv-backend-config", type=_parse_config, default=None,
                       help="JSON object of kvbackend settings, e.g. "
                            "'{\"max_pinned_fraction\": 0.25}'.")


def apply_flags(engine_args: Any, backend: str | None, config: dict | None) -> None:
    """Turn ``--kv-backend``/``--kv-backend-config`` into ``EngineArgs`` fields."""
    if backend is None:
        if config is not None:
            raise ValueError("--kv-backend-config needs --kv-backend kvbackend")
        return
    custom = engine_args.scheduler_cls
    if custom not in (None, "", engine_kwargs()["scheduler_cls"]):
        raise ValueError(f"--kv-backend replaces the scheduler; it cannot be combined with "
                         f"--scheduler-cls {custom!r}")
    other = engine_args.kv_transfer_config  # --kv-transfer-config: composed with the tiers
    for name, value in engine_kwargs(other, **(config or {})).items():
        if name == "additional_config":
            value = {**(engine_args.additional_config or {}), **value}
        elif name == "logits_processors":  # the user's --logits-processors stay
            given = list(engine_args.logits_processors or [])
            value = given + [v for v in value if v not in given]
        elif name == "kv_transfer_config" and value is not other:
            from vllm.config import KVTransferConfig
            value = KVTransferConfig(**value)
        setattr(engine_args, name, value)


def _parse_config(text: str) -> dict:
    try:
        return KVBackendConfig.from_json(text).to_dict()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


__all__ = ["ADDITIONAL_CONFIG_KEY", "BACKEND_NAMES", "add_flags", "apply_flags", "register"]
