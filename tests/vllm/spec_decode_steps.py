"""kvbackend with speculative decoding, its tree checked after every engine step, run
in a fresh process: ``python -m tests.vllm.spec_decode_steps MODEL [METHOD DRAFTER]``
(n-gram drafts, or a draft model's or an EAGLE drafter's: METHOD ``draft_model``,
``eagle`` or ``eagle3``) prints JSON with the workload's greedy outputs, cached tokens, draft and
accepted token counts, and every tree path that is no prefix of a request's token ids.

A draft token is a guess: the engine runs it, then keeps it only if the model
agrees. The tree must only ever hold a request's real tokens (prompt and accepted
output), so after each step every root-to-leaf path of the tree is checked to be
a prefix of some request's ``all_token_ids``. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to reach its scheduler; see
``same_step_branches.py`` for why it needs a process of its own.
"""

from __future__ import annotations

import os
import random
import sys

from tests.vllm.conftest import BLOCK_SIZE, make_engine, print_results, shutdown

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
MAX_TOKENS = 24


def speculative_config(drafter: tuple[str, str] | None) -> dict:
    """n-gram drafts, or ``drafter``'s: (method, path)."""
    if drafter is None:
        return NGRAM
    method, path = drafter
    return {"method": method, "model": path, "num_speculative_tokens": 3}


def repetitive(rng: random.Random, n: int) -> list[int]:
    """``n`` tokens of a short phrase repeated with variations: n-gram finds drafts in it."""
    phrase = [rng.randrange(3, 512) for _ in range(7)]
    return [rng.randrange(3, 512) if rng.random() < 0.1 else phrase[i % 7] for i in range(n)]


def workload_turns(seed: int = 5) -> tuple[list[int], list[list[int]]]:
    """A shared repetitive document (ending inside a block) and three questions on it;
    each question's conversation later continues from its own decoded output."""
    rng = random.Random(seed)
    document = repetitive(rng, 4 * BLOCK_SIZE + 11)
    return document, [document + repetitive(rng, 20 + 5 * i) for i in range(3)]


def leaf_paths(tree) -> list[list[int]]:
    """The token ids from the root to every leaf, all namespaces. O(tree tokens x depth)."""
    paths = []
    for node in tree.iter_nodes(all_namespaces=True):
        if node.children:
            continue
        parts = []
        while node is not None and not node.is_root:
            parts.append(node.tokens.tolist())
            node = node.parent
        paths.append([t for part in reversed(parts) for t in part])
    return paths


class StepChecker:
    """Wraps the scheduler: counts drafts and accepted drafts, and after each step
    records every tree path that no request's tokens start with."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.manager = scheduler, scheduler.kv_cache_manager
        self.known: dict[str, list[int]] = {}  # request id -> its token ids, latest
        self.drafts = self.accepted = 0
        self.violations: list[list[int]] = []
        update, free = scheduler.update_from_output, self.manager.free

        def checked_update(scheduler_output, runner_output):
            for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
                sampled = runner_output.sampled_token_ids[runner_output.req_id_to_index[req_id]]
                self.drafts += len(drafts)
                self.accepted += max(len(sampled) - 1, 0)
            outputs = update(scheduler_output, runner_output)
            self.check()
            return outputs

        def recorded_free(request):
            self.known[request.request_id] = list(request.all_token_ids)
            return free(request)

        scheduler.update_from_output, self.manager.free = checked_update, recorded_free

    def check(self) -> None:
        for req_id, request in self.scheduler.requests.items():
            self.known[req_id] = list(request.all_token_ids)
        sequences = list(self.known.values())
        for path in leaf_paths(self.manager.cache.tree):
            if not any(seq[: len(path)] == path for seq in sequences):
                self.violations.append(path)


def main(model: str, drafter: tuple[str, str] | None) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    llm = make_engine(model, "kvbackend", speculative_config=speculative_config(drafter))
    try:
        checker = StepChecker(llm.llm_engine.engine_core.engine_core.scheduler)
        prompts, got = run_workload(llm, params)
        print_results(got, prompts=prompts, drafts=checker.drafts, accepted=checker.accepted,
                      violations=checker.violations[:3])
    finally:
        shutdown(llm)


def run_workload(llm, params) -> tuple[list[list[int]], list]:
    """Run the workload on ``llm``: every prompt, in order, and its request output."""
    document, questions = workload_turns()
    first = llm.generate([{"prompt_token_ids": document}], params, use_tqdm=False)
    answers = llm.generate([{"prompt_token_ids": q} for q in questions], params, use_tqdm=False)
    follow_ups = [q + list(a.outputs[0].token_ids) + q[-9:] for q, a in zip(questions, answers)]
    again = llm.generate([{"prompt_token_ids": p} for p in follow_ups], params, use_tqdm=False)
    return [document] + questions + follow_ups, first + answers + again


if __name__ == "__main__":
    main(sys.argv[1], (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else None)
