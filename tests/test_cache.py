"""Compile-cache warm-up: scripts/warmup_cache.py fills a directory; a fresh process
pointed at it compiles nothing and starts faster; a cache from another stack is refused."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vitattn_bwd
from vitattn_bwd import cache

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--batch-sizes", "1", "3", "--seq-len", "9", "--embed-dim", "16", "--num-heads", "2"]

FIRST_CALL = """
import json, time, torch, vitattn_bwd
from vitattn_bwd.workloads import make_inputs
start = time.perf_counter()
for B in (1, 3):
    inputs = make_inputs(B, seq_len=9, embed_dim=16, num_heads=2)
    for mode in ("contract", "exact"):
        vitattn_bwd.attention_block_backward(**inputs, num_heads=2, ln_grad=mode)
seconds = time.perf_counter() - start
c = torch._dynamo.utils.counters["inductor"]
print(json.dumps({"seconds": seconds, "miss": c["fxgraph_cache_miss"],
                  "hit": c["fxgraph_cache_hit"]}))
"""


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return env


@pytest.fixture(scope="module")
def warmed_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "warmup_cache.py"),
                          "--cache-dir", str(path), "--no-module", *TINY],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cold_seconds = float(re.search(r"cold: ([\d.]+) s", run.stdout).group(1))
    return path, cold_seconds, run.stdout


def test_warmup_script_reports_cold_and_warm(warmed_cache):
    path, cold_seconds, stdout = warmed_cache
    assert (path / cache.FINGERPRINT_FILE).is_file()
    assert "| batch 3, exact |" in stdout
    assert re.search(r"fresh process: 0 Inductor compiles, [1-9]\d* cache hits", stdout)


def test_fresh_process_on_the_cache_compiles_nothing_and_starts_faster(warmed_cache):
    path, cold_seconds, _ = warmed_cache
    run = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True,
                         env=_env(VITATTN_BWD_CACHE=str(path)), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    warm = json.loads(run.stdout.strip().splitlines()[-1])
    assert warm["miss"] == 0 and warm["hit"] >= 1, warm
    assert warm["seconds"] < cold_seconds, (warm, cold_seconds)


def test_cache_from_another_stack_is_refused(warmed_cache, tmp_path):
    path, _, _ = warmed_cache
    stamp = json.loads((path / cache.FINGERPRINT_FILE).read_text())
    stamp["torch"] = "1.0.0"
    (tmp_path / cache.FINGERPRINT_FILE).write_text(json.dumps(stamp))
    with pytest.raises(RuntimeError, match="torch: cache '1.0.0'"):
        vitattn_bwd.load_compile_cache(tmp_path)


def test_directory_without_fingerprint_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="not a vitattn_bwd compile cache"):
        vitattn_bwd.load_compile_cache(tmp_path)
