"""Builds (JIT, on first use) and loads the C++/CUDA extension in ``csrc/``.

The build goes to ``$KVBACKEND_BUILD_DIR`` or ``~/.cache/kvbackend``, in a subfolder
per torch / Python / CUDA version, and is reused by later processes (ninja rebuilds
only when a source changed). ``KVBACKEND_DISABLE_EXTENSION=1`` makes ``get()`` return
None, so callers use their pure-torch fallback; it is read on every call.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVBACKEND_DISABLE_EXTENSION"
BUILD_DIR_ENV = "KVBACKEND_BUILD_DIR"
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"


class Extension(NamedTuple):
    ops: Any  # the torch.ops.kvbackend namespace
    has_cuda: bool  # CUDA kernels were built; otherwise CUDA tensors need the fallback


def is_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "0").strip().lower() not in ("", "0", "false", "no")


def get() -> Extension | None:
    """The loaded extension, or None when disabled or unbuildable. Cheap after the first call."""
    return None if is_disabled() else _load()


def _build_dir(variant: str) -> Path:
    root = Path(os.environ.get(BUILD_DIR_ENV) or Path.home() / ".cache" / "kvbackend")
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{variant}"
    path = root / tag.replace("+", "_")
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def _load() -> Extension | None:
    """Build (the first time: tens of seconds) and load the extension, once per process.

    Tries CPU + CUDA when torch has CUDA and nvcc is found, then CPU only. On failure logs
    one warning and returns None.
    """
    try:
        from torch.utils import cpp_extension

        cuda_possible = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    except Exception as exc:  # e.g. setuptools missing
        logger.warning("kvbackend: cannot import torch.utils.cpp_extension (%s); "
                       "using the pure-torch block copies", exc)
        return None
    if not (CSRC_DIR / "block_copy.cpp").is_file():
        logger.warning("kvbackend: %s/block_copy.cpp not found (not a source checkout?); "
                       "using the pure-torch block copies", CSRC_DIR)
        return None
    errors = []
    for with_cuda in [True, False] if cuda_possible else [False]:
        variant = f"cu{torch.version.cuda}" if with_cuda else "cpu"
        sources = [CSRC_DIR / "block_copy.cpp"]
        if with_cuda:
            sources.append(CSRC_DIR / "block_copy.cu")
        try:
            cpp_extension.load(
                name=f"kvbackend_block_copy_{variant.replace('.', '')}",
                sources=[str(s) for s in sources],
                build_directory=str(_build_dir(variant)),
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3"],
                with_cuda=with_cuda,
                is_python_module=False,
            )
            return Extension(torch.ops.kvbackend, with_cuda)
        except Exception as exc:  # compiler missing, build error, ...
            logger.debug("kvbackend: %s build of %s failed", variant, CSRC_DIR, exc_info=True)
            errors.append(f"{variant}: {type(exc).__name__}: {str(exc).strip()[:160]}")
    logger.warning("kvbackend: C++ block-copy extension unavailable, using the pure-torch "
                   "fallback (%s ...; DEBUG logging shows the build output)", "; ".join(errors))
    return None
