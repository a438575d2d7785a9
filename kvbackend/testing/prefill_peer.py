"""A prefill instance for prefill/decode disaggregation over vLLM's NIXL connector, in its
own process (a NIXL peer must be another process), driven one JSON line at a time; for
tests and benchmarks (``PrefillPeer`` starts and drives it).

    python -m kvbackend.testing.prefill_peer ENGINE_KWARGS_JSON

The process builds ``vllm.LLM(**engine_kwargs)`` (their ``kv_transfer_config`` selects
NIXL), prints ``REPLY + "ready"``, then answers each line ``{"prompt": [...],
"remote_decode": bool, "max_tokens": n}`` with ``REPLY`` and ``{"params": ...,
"tokens": [...], "cached": n, "seconds": s, "nixl_bytes": b}``: with ``remote_decode``
the request is prefilled for a decode instance (one token; ``params`` is what that
instance needs to pull its KV, or to have it pushed, which this engine holds until then),
else served here. ``nixl_bytes``: the bytes this engine's NIXL transfers moved so far
(pushed, in push mode), None unless ``disable_log_stats=False``. vLLM logs to
stdout too: replies are the lines after ``REPLY``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

from kvbackend.testing.ports import free_port

REPLY = "prefill_peer: "
NIXL_BYTES = "vllm:nixl_bytes_transferred"  # vLLM's histogram of bytes per NIXL transfer
PROBE = [7, 8, 9]  # the prompt of ``moved_bytes``'s one-token request


def nixl_engine_env() -> dict[str, str]:
    """Environment for one vLLM CPU engine (one rank) running NIXL: its own side-channel
    port, and its OpenMP threads bound off the cores vLLM's NIXL worker reserves for
    transfers (the last core of each NUMA node, where it pins the worker's main thread).
    With vLLM's default binding ("auto", every core) the threads bound to the reserved
    core stall each other: a prefill on this 2-core machine took 1.3 s instead of 0.1 s.
    Without a core to spare, vLLM's binding stays."""
    from vllm.platforms import current_platform

    spare = [c for node in current_platform.discover_numa_topology() for c in node
             if c != max(node)]
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    if spare:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, spare))
    return env


@contextlib.contextmanager
def nixl_engine():
    """An engine built inside the block gets ``nixl_engine_env()`` (its engine core and
    worker read it as they start); the environment is restored after."""
    env = nixl_engine_env()
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def decode_prefilled(llm, prefilled: dict, prompt: list[int], params):
    """The decode instance's side: ``llm``'s finished output for ``prompt`` from the KV a
    prefill instance holds for it (``prefilled``: ``PrefillPeer.ask``'s reply), with
    ``params`` (``SamplingParams``; their ``kv_transfer_params`` are set here). The request
    is named as the prefill's: NIXL's push mode pairs the two by id, as a P/D proxy gives
    both requests the client's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

    params = params.clone()
    params.extra_args = {**(params.extra_args or {}),
                         "kv_transfer_params": prefilled["params"]}
    request_id = get_base_request_id(prefilled["params"]["remote_request_id"])
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise RuntimeError(f"request {request_id} did not finish")


def moved_bytes(peer: PrefillPeer, decode) -> float:
    """The bytes NIXL moved so far between the prefill process ``peer`` and the decode
    engine ``decode`` (both with stats on): pulled, which the decode engine counts, or
    pushed, which the prefill engine does (a one-token request brings its count up to
    date)."""
    pushed = peer.ask(PROBE, False, max_tokens=1)["nixl_bytes"]
    return pushed + sum(m.sum for m in decode.get_metrics() if m.name == NIXL_BYTES)


class PrefillPeer:
    """The prefill process, started with ``engine_kwargs`` and its own NIXL side-channel
    port; ``ask`` sends one request and returns its reply."""

    def __init__(self, engine_kwargs: dict) -> None:
        env = {**os.environ, **nixl_engine_env(), "PYTHONUNBUFFERED": "1",
               "VLLM_NO_USAGE_STATS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(engine_kwargs)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env)
        if self._reply() != "ready":
            raise RuntimeError("the prefill process did not start")

    def ask(self, prompt: list[int], remote_decode: bool, max_tokens: int = 4) -> dict:
        order = {"prompt": prompt, "remote_decode": remote_decode, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._reply())

    def close(self) -> None:
        """End the process: it shuts its engine down (its engine core and worker are
        processes of their own), or is killed after a minute."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _reply(self) -> str:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return line[len(REPLY):].strip()
        raise RuntimeError(f"the prefill process exited ({self.proc.wait()})")


def main() -> None:
    import vllm

    llm = vllm.LLM(**json.loads(sys.argv[1]))
    try:
        print(REPLY + "ready", flush=True)
        for line in sys.stdin:
            print(REPLY + json.dumps(serve(llm, json.loads(line))), flush=True)
    finally:  # a worker left behind would spin on a core
        llm.llm_engine.engine_core.shutdown()


def serve(llm, order: dict) -> dict:
    """One request of the driving process (see the module docstring)."""
    import vllm

    remote = order["remote_decode"]
    params = vllm.SamplingParams(
        temperature=0, max_tokens=1 if remote else order["max_tokens"],
        extra_args={"kv_transfer_params": {"do_remote_decode": True}} if remote else {})
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": order["prompt"]}], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    nixl_bytes = (sum(m.sum for m in llm.get_metrics() if m.name == NIXL_BYTES)
                  if llm.llm_engine.log_stats else None)
    return {"params": out.kv_transfer_params, "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens or 0, "seconds": seconds, "nixl_bytes": nixl_bytes}


if __name__ == "__main__":
    main()
