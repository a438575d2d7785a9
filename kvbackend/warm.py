"""``kvbackend warm``: compute prompts once, offline, and leave their KV blocks on disk.

    kvbackend warm --model MODEL --prompts FILE.jsonl --disk-cache-dir DIR
                   [--disk-cache-gb GB] [--kv-backend-config JSON] [--no-progress]
                   [any vLLM engine option, e.g. --dtype float32 --max-model-len 8192]

FILE.jsonl holds one JSON object a line: ``{"prompt": "text"}`` or
``{"prompt_token_ids": [1, 2, ...]}``, optionally with ``"cache_salt": "..."`` (the
namespace the server's requests will name); blank lines are skipped. The whole file is
checked before the engine starts, and token ids against the model's vocabulary and
length limit once it has: a bad line stops the command with its line number, nothing
computed. Each prompt then runs once through vLLM with kvbackend's disk tier (one
greedy output token); the tier writes every computed block through, so a server
started later on DIR with the same model and KV layout serves these prefixes from its
first request. Options vLLM's engine parser knows pass through unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

PROMPT_KEYS = ("prompt", "prompt_token_ids")
ALLOWED_KEYS = frozenset((*PROMPT_KEYS, "cache_salt"))


class BadPrompts(ValueError):
    """A prompts file that cannot be warmed; the message names the file and line."""


def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise BadPrompts(f"{where}: expected a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - ALLOWED_KEYS)
    if unknown:
        raise BadPrompts(f"{where}: unknown key(s) {unknown}; allowed: {sorted(ALLOWED_KEYS)}")
    given = [k for k in PROMPT_KEYS if k in entry]
    if len(given) != 1:
        raise BadPrompts(f"{where}: needs exactly one of \"prompt\" and \"prompt_token_ids\", "
                         f"got {given or 'neither'}")
    if "prompt" in entry and (not isinstance(entry["prompt"], str) or not entry["prompt"]):
        raise BadPrompts(f"{where}: \"prompt\" must be a non-empty string")
    ids = entry.get("prompt_token_ids")
    if "prompt_token_ids" in entry and (
            not isinstance(ids, list) or not ids
            or not all(type(t) is int and t >= 0 for t in ids)):
        raise BadPrompts(f"{where}: \"prompt_token_ids\" must be a non-empty list of "
                         f"non-negative integers")
    salt = entry.get("cache_salt")
    if "cache_salt" in entry and (not isinstance(salt, str) or not salt):
        raise BadPrompts(f"{where}: \"cache_salt\" must be a non-empty string")
    return entry


def read_prompts(path: str) -> list[tuple[int, dict[str, Any]]]:
    """The file's prompts as ``(line number, vLLM prompt dict)``; BadPrompts on any bad
    line. O(file size)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadPrompts(f"cannot read prompts file {path}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadPrompts(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        prompts.append((number, _check_entry(entry, where)))
    if not prompts:
        raise BadPrompts(f"{path}: no prompts")
    return prompts


def check_token_ids(prompts: list[tuple[int, dict[str, Any]]], path: str, *,
                    vocab_size: int, max_model_len: int) -> None:
    """BadPrompts naming the first line whose token ids the model cannot take."""
    for number, entry in prompts:
        ids = entry.get("prompt_token_ids")
        if ids is None:
            continue
        if max(ids) >= vocab_size:
            raise BadPrompts(f"{path}:{number}: token id {max(ids)} is outside the model's "
                             f"vocabulary (size {vocab_size})")
        if len(ids) >= max_model_len:
            raise BadPrompts(f"{path}:{number}: {len(ids)} tokens leave no room for an output "
                             f"token within max_model_len {max_model_len}")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_parser(top: argparse._SubParsersAction) -> None:
    p = top.add_parser("warm", help="compute prompts once and leave their KV blocks on disk",
                       description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl")
    p.add_argument("--disk-cache-dir", required=True, metavar="DIR")
    p.add_argument("--disk-cache-gb", type=float, help="the disk tier's size bound (default 16)")
    p.add_argument("--kv-backend-config", type=_json_object, default={}, metavar="JSON",
                   help="further kvbackend keys, as for the server's --kv-backend-config")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run, engine_options=True)


def engine_options(extra: list[str]) -> dict[str, Any]:
    """The vLLM engine options given in ``extra`` (vLLM's own parser), as LLM keywords:
    only those that differ from vLLM's defaults."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="kvbackend warm"))
    defaults = vars(parser.parse_args([]))
    given = vars(parser.parse_args(extra))
    return {k: v for k, v in given.items() if v != defaults.get(k) and k != "model"}


def run(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        prompts = read_prompts(args.prompts)
    except BadPrompts as e:
        print(f"kvbackend warm: {e}", file=sys.stderr)
        return 2
    import kvbackend.vllm

    config = {**args.kv_backend_config, "disk_cache_dir": args.disk_cache_dir}
    if args.disk_cache_gb is not None:
        config["disk_cache_gb"] = args.disk_cache_gb
    try:
        kwargs = {**engine_options(extra), **kvbackend.vllm.engine_kwargs(**config)}
    except ValueError as e:
        print(f"kvbackend warm: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, **kwargs)
    try:
        model_config = llm.llm_engine.model_config
        check_token_ids(prompts, args.prompts, vocab_size=model_config.get_vocab_size(),
                        max_model_len=model_config.max_model_len)
        outputs = llm.generate([entry for _, entry in prompts],
                               SamplingParams(temperature=0, max_tokens=1),
                               use_tqdm=not args.no_progress)
    except ValueError as e:  # BadPrompts, or a text prompt vLLM refuses (too long)
        print(f"kvbackend warm: {e}", file=sys.stderr)
        return 2
    finally:
        llm.llm_engine.engine_core.shutdown()  # the tier's writes are finished
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    print(f"warmed {len(outputs)} prompts, {tokens} tokens ({cached} were cached already) "
          f"into {args.disk_cache_dir}")
    return 0
