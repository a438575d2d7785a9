"""The CUDA kernels in csrc/ build with nvcc wherever torch has CUDA and a toolkit exists.

Runs without a GPU: the build targets ``TORCH_CUDA_ARCH_LIST`` (default here: 9.0)
because there is no device to ask. ``make test`` runs this file in .venv-sglang, whose
torch is a CUDA build; in the vLLM CPU environment it skips. Running the kernels needs
a GPU: tests/test_block_copy_ops.py::test_cuda_matches_loop does that where one exists.
"""

import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def _cuda_home() -> str | None:
    """The toolkit root: $CUDA_HOME, else /usr/local/cuda, else the parent of nvcc's bin."""
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if candidate and os.path.isfile(os.path.join(candidate, "include", "cuda_runtime.h")):
            return candidate
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


@pytest.mark.skipif(torch.version.cuda is None, reason="torch is a CPU build")
@pytest.mark.skipif(_cuda_home() is None, reason="no CUDA toolkit (nvcc) found")
def test_cuda_kernels_build_with_nvcc(tmp_path):
    env = dict(os.environ, CUDA_HOME=_cuda_home(), KVBACKEND_BUILD_DIR=str(tmp_path))
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    env.pop("KVBACKEND_DISABLE_EXTENSION", None)
    script = ("import logging; logging.basicConfig(level=logging.DEBUG)\n"
              "from kvbackend.ops import _extension\n"
              "ext = _extension.get()\n"
              "assert ext is not None and ext.has_cuda, 'CUDA kernels did not build'\n"
              "assert hasattr(ext.ops, 'gather_blocks') and hasattr(ext.ops, 'copy_blocks')\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)
    log = "\n".join(line for line in done.stderr.splitlines() if "numba" not in line)
    assert done.returncode == 0, log[-4000:]
