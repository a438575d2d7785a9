"""``kvbackend`` command line: warm, inspect and maintain a disk cache; explain misses.

    kvbackend warm --model MODEL --prompts FILE.jsonl --disk-cache-dir DIR [...]   (warm.py)
    kvbackend cache stats|verify|clear DIR [...]                                   (cache_cli.py)
    kvbackend explain FILE [--tokenizer MODEL_DIR]                                 (explain_cli.py)

Each command's module adds its parser and runs it; this one only dispatches.
Exit codes: 0 success, 1 bad files found (cache verify), 2 usage error.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at module level: vLLM's spawned workers (``kvbackend warm``)
    # re-import the main module, and the store loads numba, which must not be loaded
    # in a worker before vLLM rebinds its Triton kernels there.
    from kvbackend import cache_cli, explain_cli, warm

    parser = argparse.ArgumentParser(prog="kvbackend", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="group", required=True)
    warm.add_parser(top)
    cache_cli.add_parser(top)
    explain_cli.add_parser(top)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "engine_options", False):
        return args.run(args, extra)  # the rest are vLLM engine options
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
