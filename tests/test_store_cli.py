"""`kvbackend cache stats|verify|clear` on real cache directories."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvbackend.cli import main
from kvbackend.store.disk_tier import FORMAT_DIR, DiskTier
from tests.store_helpers import key_of, make_identity, payload_for

MODEL_A, MODEL_B = "aa" * 32, "bb" * 32


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / "cache"
    a = DiskTier(root, 10**7, make_identity(model=MODEL_A))
    b = DiskTier(root, 10**7, make_identity(model=MODEL_B, tp_rank=1, tp_size=2))
    for i in range(3):
        a.put(key_of(i), payload_for(key_of(i), 1000), 16)
    b.put(key_of(0), payload_for(key_of(0), 500), 16)
    return root, a, b


def block_paths(root):
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root)
                  for n in names if n.endswith(".kvb"))


def test_stats_text_and_json(cache, capsys):
    root, a, b = cache
    assert main(["cache", "stats", str(root)]) == 0
    out = capsys.readouterr().out
    assert "4 blocks" in out and "2 identities" in out
    assert a.identity_digest[:12] in out and MODEL_B[:12] in out and "1/2" in out
    assert main(["cache", "stats", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["entries"] == 4 and data["bytes"] == 3 * 1128 + 628
    per = {r["model"]: r for r in data["identities"]}
    assert per[MODEL_A]["entries"] == 3 and per[MODEL_B]["bytes"] == 628


def test_verify_clean_then_corrupt(cache, capsys):
    root, a, _ = cache
    assert main(["cache", "verify", str(root)]) == 0
    captured = capsys.readouterr()
    assert "4 ok, 0 bad" in captured.out and "verify [" in captured.err and "4/4" in captured.err
    bad = block_paths(a.base)[1]
    with open(bad, "r+b") as f:
        f.seek(500)
        byte = f.read(1)
        f.seek(500)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["cache", "verify", str(root), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert f"BAD {bad}: checksum mismatch" in captured.out and "3 ok, 1 bad" in captured.out
    assert captured.err == ""
    assert os.path.exists(bad)  # verify alone does not delete
    assert main(["cache", "verify", str(root), "--no-progress", "--delete"]) == 1
    assert not os.path.exists(bad)
    assert main(["cache", "verify", str(root), "--no-progress"]) == 0


def test_older_format_tree_is_ignored(cache, capsys):
    root, _, _ = cache
    old = root / "v1"
    shutil.copytree(root / FORMAT_DIR, old)  # a format-1 tree left behind
    old_files = block_paths(old)
    assert main(["cache", "stats", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 4
    assert main(["cache", "verify", str(root), "--no-progress"]) == 0
    assert "verified 4 block files" in capsys.readouterr().out
    assert main(["cache", "clear", str(root)]) == 0
    assert block_paths(root) == old_files  # clear leaves it alone


def test_clear_by_model_prefix_then_all(cache, capsys):
    root, a, b = cache
    foreign = root / "README.txt"
    foreign.write_text("not ours")
    assert main(["cache", "clear", str(root), "--model", MODEL_B[:6]]) == 0
    assert "removed 1 block files" in capsys.readouterr().out
    assert not os.path.exists(b.base) and len(block_paths(root)) == 3
    assert main(["cache", "clear", str(root), "--model", a.identity_digest[:8]]) == 0
    assert block_paths(root) == [] and not os.path.exists(a.base)
    assert main(["cache", "clear", str(root), "--model", "ffff"]) == 0
    assert "no identity matches" in capsys.readouterr().out
    assert foreign.exists()  # only the format's own files are removed


def test_clear_everything(cache, capsys):
    root, _, _ = cache
    assert main(["cache", "clear", str(root)]) == 0
    assert "removed 4 block files" in capsys.readouterr().out and block_paths(root) == []


def test_missing_dir_and_usage_errors(tmp_path, capsys):
    assert main(["cache", "stats", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["cache"])
    assert e.value.code == 2


def test_module_entry_point(cache):
    root, _, _ = cache
    out = subprocess.run([sys.executable, "-m", "kvbackend.cli", "cache", "stats", str(root)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "4 blocks" in out.stdout
