"""SGLang adapter tests: real SGLang 0.5.23 classes on the CPU (run in .venv-sglang).

Each module skips itself (pytest.importorskip) where sglang is not importable: the
main .venv holds vLLM, so there the whole directory reports as skipped.
"""

import warnings

import pytest

warnings.filterwarnings("ignore", message="Only CUDA, MUSA and NPU support GGUF")


@pytest.fixture(scope="session", autouse=True)
def sglang_config():
    """Publish SGLang's default server config (release_kv_cache reads it), as its own tests do."""
    from sglang.srt import runtime_context

    with runtime_context._CONTEXT.override_server_args():
        yield
