"""``kvbackend warm``: prompts computed once by the CLI (a subprocess, the real vLLM
engine) are served from the disk tier by a fresh engine's first request; bad prompt
files are refused with the line named, before any engine starts."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from vllm import SamplingParams

from kvbackend.cli import main
from kvbackend.vllm import engine_kwargs
from kvbackend.warm import BadPrompts, check_token_ids
from tests.vllm.conftest import BLOCK_SIZE, MAX_MODEL_LEN, make_engine, shutdown

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def write_lines(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "w1 w2"}', "{not json"], ":2: not valid JSON"),
    (['{"prompt": "w1", "prompt_token_ids": [5]}'], ':1: needs exactly one of "prompt" and'),
    (['', '{"cache_salt": "a"}'], ":2: needs exactly one of"),
    (['{"prompt_token_ids": [5, "6"]}'], ':1: "prompt_token_ids" must be a non-empty list'),
    (['{"prompt_token_ids": [5, -1]}'], ':1: "prompt_token_ids" must be a non-empty list'),
    (['{"prompt_token_ids": [5, true]}'], ':1: "prompt_token_ids" must be a non-empty list'),
    (['{"prompt": "w1", "cache_salt": 7}'], ':1: "cache_salt" must be a non-empty string'),
    (['{"prompt": "w1", "salt": "x"}'], ":1: unknown key(s) ['salt']"),
    (['[1, 2]'], ":1: expected a JSON object, got list"),
    ([''], ": no prompts"),
])
def test_bad_lines_are_refused_with_their_line(tmp_path, capsys, lines, message):
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    code = main(["warm", "--model", "unused", "--prompts", prompts,
                 "--disk-cache-dir", str(tmp_path / "d")])
    assert code == 2
    err = capsys.readouterr().err
    assert f"kvbackend warm: {prompts}{message}" in err, err
    assert not (tmp_path / "d").exists()


def test_a_missing_file_is_named(tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    assert main(["warm", "--model", "m", "--prompts", missing, "--disk-cache-dir", "d"]) == 2
    assert f"cannot read prompts file {missing}" in capsys.readouterr().err


def test_token_ids_outside_the_model_are_named():
    prompts = [(1, {"prompt": "w1"}), (3, {"prompt_token_ids": [4, 511]}),
               (4, {"prompt_token_ids": [4, 512]})]
    with pytest.raises(BadPrompts, match=r"^f:4: token id 512 is outside the model's vocab"):
        check_token_ids(prompts, "f", vocab_size=512, max_model_len=100)
    with pytest.raises(BadPrompts, match=r"^f:3: 2 tokens leave no room"):
        check_token_ids(prompts[:2], "f", vocab_size=512, max_model_len=2)


def test_warmed_prompts_hit_the_disk_in_a_fresh_engine(tiny_model, reference_llm, tmp_path):
    rng = random.Random(12)
    documents = [[rng.randrange(3, 512) for _ in range(n)] for n in (300, 450)]
    text = " ".join(f"w{rng.randrange(0, 509)}" for _ in range(200))
    prompts = write_lines(tmp_path / "warm.jsonl", [
        json.dumps({"prompt_token_ids": documents[0]}),
        json.dumps({"prompt_token_ids": documents[1], "cache_salt": "tenant-a"}),
        json.dumps({"prompt": text})])
    disk = str(tmp_path / "disk")
    engine_options = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                      "--enforce-eager", "--block-size", str(BLOCK_SIZE),
                      "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "kvbackend.cli", "warm", "--model", tiny_model,
         "--prompts", prompts, "--disk-cache-dir", disk, "--no-progress", *engine_options],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warmed 3 prompts" in done.stdout, done.stdout

    # A question after each warmed prefix; the first request of a new engine.
    asks = [({"prompt_token_ids": documents[0] + [7, 8, 9]}, 300),
            ({"prompt_token_ids": documents[1] + [7, 8], "cache_salt": "tenant-a"}, 450),
            ({"prompt_token_ids": documents[1] + [7, 8]}, 0),  # no salt: another namespace
            ({"prompt": text + " w3 w4"}, 200)]
    llm = make_engine(tiny_model, "kvbackend", **engine_kwargs(disk_cache_dir=disk))
    try:
        outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p, _ in asks]
    finally:
        shutdown(llm)
    reference = reference_llm.generate([p for p, _ in asks], GREEDY, use_tqdm=False)
    for (_, warmed), out, ref in zip(asks, outputs, reference):
        assert out.num_cached_tokens == warmed // BLOCK_SIZE * BLOCK_SIZE
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
