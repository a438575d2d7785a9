"""Per-request options (``kv_priority``, ``kv_pin``, ``kv_retain_s``): one parser, checked
before the engine.

The HTTP side (400 from the OpenAI server) is in ``test_server.py``, which already
starts a server; here the parser's rules and the offline ``LLM.generate`` path.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from kvbackend.vllm.request_options import (
    RequestOptionError, RequestOptions, parse_request_options,
)

GOOD = [
    (None, RequestOptions()),
    ({}, RequestOptions()),
    ({"unrelated": "x", "kv_transfer_params": {}}, RequestOptions()),
    ({"kv_priority": 7}, RequestOptions(priority=7)),
    ({"kv_priority": -3, "kv_pin": True}, RequestOptions(priority=-3, pin=True)),
    ({"kv_pin": 1}, RequestOptions(pin=True)),  # vllm_xargs' JSON true
    ({"kv_pin": 0}, RequestOptions(pin=False)),
    ({"kv_pin": "TRUE"}, RequestOptions(pin=True)),
    ({"kv_pin": "false"}, RequestOptions(pin=False)),
    ({"kv_retain_s": 30}, RequestOptions(retain_s=30.0)),
    ({"kv_retain_s": 2.5, "kv_priority": 1}, RequestOptions(priority=1, retain_s=2.5)),
    ({"kv_retain_s": 0}, RequestOptions()),
]
BAD = [
    ({"kv_priority": "high"}, "kv_priority"),
    ({"kv_priority": 1.5}, "kv_priority"),
    ({"kv_priority": True}, "kv_priority"),
    ({"kv_priority": None}, "kv_priority"),
    ({"kv_pin": "maybe"}, "kv_pin"),
    ({"kv_pin": 2}, "kv_pin"),
    ({"kv_pin": 1.0}, "kv_pin"),
    ({"kv_pin": [True]}, "kv_pin"),
    ({"kv_retain_s": -1}, "kv_retain_s"),
    ({"kv_retain_s": "30"}, "kv_retain_s"),
    ({"kv_retain_s": float("inf")}, "kv_retain_s"),
    ({"kv_retain_s": float("nan")}, "kv_retain_s"),
    ({"kv_retain_s": True}, "kv_retain_s"),
]


@pytest.mark.parametrize("extra_args,expected", GOOD)
def test_good_options_parse(extra_args, expected):
    assert parse_request_options(extra_args) == expected


@pytest.mark.parametrize("extra_args,option", BAD)
def test_bad_options_name_the_option(extra_args, option):
    with pytest.raises(RequestOptionError, match=option) as info:
        parse_request_options(extra_args)
    assert info.value.option == option
    assert repr(extra_args[option]) in str(info.value)


@pytest.mark.parametrize("extra_args,option", [BAD[0], BAD[4]])
def test_offline_generate_rejects_bad_options(kvbackend_llm, extra_args, option):
    params = SamplingParams(max_tokens=2, temperature=0, extra_args=extra_args)
    with pytest.raises(VLLMValidationError, match=option):
        kvbackend_llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
    # The engine keeps serving, and good options still work.
    good = SamplingParams(max_tokens=2, temperature=0, extra_args={"kv_pin": 1, "kv_priority": 2})
    (out,) = kvbackend_llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], good, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_kv_backend_flag_adds_the_validator_after_the_users_processors():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvbackend.vllm import OPTIONS_VALIDATOR
    from kvbackend.vllm.plugin import register

    register()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    argv = ["--model", "m", "--logits-processors", "my.module:MyProcessor"]
    args = EngineArgs.from_cli_args(parser.parse_args(argv + ["--kv-backend", "kvbackend"]))
    assert args.logits_processors == ["my.module:MyProcessor", OPTIONS_VALIDATOR]
    assert EngineArgs.from_cli_args(parser.parse_args(argv)).logits_processors == [
        "my.module:MyProcessor"]


@pytest.mark.parametrize("value", [-0.1, 1.5, "half", True, float("nan")])
def test_max_retained_fraction_is_checked_like_max_pinned_fraction(value):
    from kvbackend.vllm.config import KVBackendConfig

    assert KVBackendConfig.from_dict({"max_retained_fraction": 0.25}).max_retained_fraction == 0.25
    with pytest.raises(ValueError, match="max_retained_fraction must be a number in"):
        KVBackendConfig.from_dict({"max_retained_fraction": value})
