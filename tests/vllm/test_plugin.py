"""The plugin's flags in vLLM's own argument parsing: without ``--kv-backend`` vLLM's
engine arguments are exactly what they are without kvbackend installed."""

from __future__ import annotations

import subprocess
import sys

from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from kvbackend.vllm import SCHEDULER_CLS, TIER_CONNECTOR
from kvbackend.vllm.config import ADDITIONAL_CONFIG_KEY
from kvbackend.vllm.plugin import register
from tests.vllm.conftest import numba_modules_after

ARGV = ["--model", "some-model", "--enable-prefix-caching", "--block-size", "32"]


def parse(argv: list[str]) -> EngineArgs:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_not_selected_changes_nothing():
    """Parsed in a fresh process that never registers the plugin, then here with it."""
    script = ("from tests.vllm.test_plugin import ARGV, parse\n"
              "from vllm.engine.arg_utils import EngineArgs\n"
              "assert not getattr(EngineArgs, '_kvbackend_flags', False)\n"
              "print(repr(parse(ARGV)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    register()
    register()  # idempotent
    assert repr(parse(ARGV)) == done.stdout.strip().splitlines()[-1]


def test_selected_sets_scheduler_and_config():
    register()
    args = parse(ARGV + ["--kv-backend", "kvbackend",
                         "--kv-backend-config", '{"max_pinned_fraction": 0.25}'])
    assert args.scheduler_cls == SCHEDULER_CLS
    assert args.enable_prefix_caching is False
    assert args.async_scheduling is None  # vLLM decides (on a GPU: on)
    assert args.additional_config[ADDITIONAL_CONFIG_KEY]["max_pinned_fraction"] == 0.25
    assert args.kv_transfer_config is None  # no tier keys: no connector


def test_tiers_leave_async_scheduling_to_vllm():
    register()
    tiers = ["--kv-backend", "kvbackend", "--kv-backend-config", '{"host_cache_gb": 1}']
    assert parse(ARGV + tiers).async_scheduling is None  # vLLM decides (on a GPU: on)
    assert parse(ARGV + tiers + ["--async-scheduling"]).async_scheduling is True


def test_kv_transfer_config_is_composed_with_the_tiers():
    register()
    other = ["--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}']
    alone = parse(ARGV + ["--kv-backend", "kvbackend"] + other).kv_transfer_config
    assert (alone.kv_connector, alone.kv_role) == ("ExampleConnector", "kv_both")
    tiers = ["--kv-backend", "kvbackend", "--kv-backend-config", '{"host_cache_gb": 1}']
    multi = parse(ARGV + tiers + other).kv_transfer_config
    assert multi.kv_connector == "MultiConnector"
    first, second = multi.kv_connector_extra_config["connectors"]
    assert first["kv_connector"] == TIER_CONNECTOR and first["kv_connector_extra_config"]
    assert second == {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}


def test_loading_the_plugin_does_not_load_numba():
    """vLLM loads the plugin in every process, before a worker rebinds its Triton kernels
    by walking ``sys.modules``; llvmlite (numba's) loaded by then breaks the worker's start."""
    assert numba_modules_after("from kvbackend.vllm.plugin import register\n"
                               "register()\n"
                               "from kvbackend.vllm import engine_kwargs\n"
                               "engine_kwargs(host_cache_gb=1)") == "[]"
