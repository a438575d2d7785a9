"""An EAGLE / MTP / DFlash drafter's KV after a kvbackend hit, read from the worker's KV
cache, in a fresh process: ``python -m tests.vllm.drafter_kv MODEL METHOD [DRAFTER]``
(METHOD ``eagle``, ``eagle3`` or ``dflash`` with a drafter, ``mtp`` with a model that has
MTP layers) prints JSON.

The drafter's KV at a position also reads the next token. Request A computes a
two-block document X and its question; request B shares X and asks another question,
so the tree vouches for B's tokens through the end of X only. B must then recompute
X's last token (a partial hit on X's second block: copied, its last slot written
again), and B's copy of that block must hold, in the drafter's layer, what request D
(B again under another cache salt: computed from scratch) computes there, not A's
(whose last slot read A's next token; a DFlash drafter's context KV reads the target's
hidden states only, so there A's, B's and D's agree). The target's layers of the two copies are
equal, and so are B's and D's greedy outputs. Then the device cache is dropped and B
runs again (E), loading the document's first block from the host tier: E's copy must
hold, in every layer, what D's holds (a tier save taken before the drafter wrote its
KV of the step would not). The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to reach the worker's KV cache; see
``same_step_branches.py`` for why it needs a process of its own.
"""

from __future__ import annotations

import os
import random
import sys

from kvbackend.vllm import engine_kwargs
from tests.vllm.conftest import BLOCK_SIZE, make_engine, random_tokens, shutdown


def main(model: str, method: str, drafter: str | None = None) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import json

    from vllm import SamplingParams

    spec = {"method": method, "num_speculative_tokens": 1 if method == "mtp" else 3,
            **({"model": drafter} if drafter else {})}
    llm = make_engine(model, "kvbackend", speculative_config=spec,
                      **engine_kwargs(host_cache_gb=0.05))
    try:
        core = llm.llm_engine.engine_core.engine_core
        tables = _record_block_tables(core.scheduler.kv_cache_manager)
        document = random_tokens(random.Random(3), 2 * BLOCK_SIZE)
        a, b = document + [7, 8, 9, 10], document + [11, 12, 13, 14]
        prompts = [{"prompt_token_ids": a}, {"prompt_token_ids": b},
                   {"prompt_token_ids": b, "cache_salt": "fresh"}]
        params = SamplingParams(temperature=0, max_tokens=4)
        got = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert llm.reset_prefix_cache()  # the device tree only: the host tier keeps its blocks
        got += llm.generate([prompts[1]], params, use_tqdm=False)  # E: B from the host tier
        # per layer (target?, KV): A's, B's and D's copies of the document's second block,
        # then D's and E's of its first
        runner = core.model_executor.driver_worker.worker.model_runner
        num_target = core.vllm_config.model_config.get_num_layers(
            core.vllm_config.parallel_config)
        blocks = [tables[0][1], tables[1][1], tables[2][1], tables[2][0], tables[3][0]]
        layers = [(_is_target_layer(name, num_target), layer.kv_cache[blocks])
                  for name, layer in runner.compilation_config.static_forward_context.items()
                  if hasattr(layer, "kv_cache")]
    finally:
        shutdown(llm)

    def max_diff(target: bool, i: int, j: int) -> float:
        return max(float((kv[i] - kv[j]).abs().max()) for is_target, kv in layers
                   if is_target == target)

    print(json.dumps({"cached": [g.num_cached_tokens for g in got], "blocks": blocks,
                      "outputs": [list(g.outputs[0].token_ids) for g in got],
                      "num_drafter_layers": sum(not t for t, _ in layers),
                      "target_b_vs_a": max_diff(True, 1, 0),
                      "drafter_b_vs_fresh": max_diff(False, 1, 2),
                      "drafter_b_vs_a": max_diff(False, 1, 0),
                      "target_loaded_vs_fresh": max_diff(True, 4, 3),
                      "drafter_loaded_vs_fresh": max_diff(False, 4, 3)}))


def _is_target_layer(name: str, num_target: int) -> bool:
    """Whether attention layer ``name`` is the target's (``model.layers.<i>.`` below
    ``num_target``), not the drafter's (EAGLE, DFlash: ``model.layers.<num_target>.``; MTP:
    ``model.mtp_layers.<i>.``)."""
    parts = name.split(".")
    return parts[:2] == ["model", "layers"] and int(parts[2]) < num_target


def _record_block_tables(manager) -> list[list[int]]:
    """The block table of every request the manager frees, in the order freed."""
    tables, free = [], manager.free

    def recorded(request):
        tables.append(list(manager.get_blocks(request.request_id).get_block_ids()[0]))
        return free(request)

    manager.free = recorded
    return tables


if __name__ == "__main__":
    main(*sys.argv[1:])
