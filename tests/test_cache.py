"""Compile-cache warm-up: scripts/warmup_cache.py fills a directory; a fresh process
pointed at it compiles nothing (Inductor's cache counters: no miss; how much sooner it
starts is the script's report, not asserted); a cache from another stack is refused.
VITATTN_BWD_CACHE is read at the first compile, once, never at import. The cache-key tag
hashes every source of ours that the compiled graph and its lowering import."""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import vitattn_bwd
from vitattn_bwd import cache

ROOT = Path(__file__).resolve().parent.parent
# One batch size (its bucket's graph per LayerNorm-gradient mode): each warm-up here is a
# cold compile in a fresh process, three of them in this file.
TINY = ["--batch-sizes", "3", "--seq-len", "9", "--embed-dim", "16", "--num-heads", "2"]

FIRST_CALL = """
import json, time, torch, vitattn_bwd
from vitattn_bwd.workloads import make_inputs
start = time.perf_counter()
for B in (3,):
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
    # the warm first calls' breakdown: dynamo's phase timers, real numbers, consistent
    phase = {name.strip(): float(value) for name, value in
             re.findall(r"^\| ( *[a-zA-Z][^|]*?) \| ([\d.]+) \|$", stdout, re.M)}
    total = float(re.search(r"warm first calls \(default\): ([\d.]+) s in all", stdout).group(1))
    assert phase["dynamo compile, all of it"] > 0 and phase["dynamo bytecode tracing"] > 0
    assert phase["dynamo bytecode tracing"] <= phase["dynamo compile, all of it"] <= total + 0.01
    assert phase["AOTAutograd cache: Inductor load"] > 0         # loaded, not compiled


def test_own_tag_is_read_once_per_process(monkeypatch):
    """The tag of the running package is computed once: a source edited on disk later
    cannot make later compiles (or the fingerprint) disagree with earlier ones."""
    first = cache.cache_key_tag()
    monkeypatch.setattr(cache, "_tag_of", lambda *a: "vitattn_bwd-edited")
    assert cache.cache_key_tag() == first
    assert cache.fingerprint()["vitattn_bwd"] == first
    assert cache.cache_key_tag(Path(cache.__file__).parent) == "vitattn_bwd-edited"


def test_fresh_process_on_the_cache_compiles_nothing(warmed_cache):
    path, _, _ = warmed_cache
    run = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True,
                         env=_env(VITATTN_BWD_CACHE=str(path)), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    warm = json.loads(run.stdout.strip().splitlines()[-1])
    assert warm["miss"] == 0 and warm["hit"] >= 1, warm


def test_a_process_under_the_deterministic_flag_needs_a_cache_warmed_under_it(
        warmed_cache, tmp_path):
    """Inductor's cache key holds torch.use_deterministic_algorithms: a warm-up with
    --deterministic on a copy of the cache warmed without the flag finds no graph there
    (one mode's graph: each is a cold compile) and compiles it; the cache it leaves
    serves a fresh process under the flag every graph (0 compiles; the VITATTN_BWD_CACHE
    route to a cache: test_fresh_process_on_the_cache_compiles_nothing)."""
    path, _, _ = warmed_cache
    warmed = tmp_path / "deterministic"
    shutil.copytree(path, warmed)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "warmup_cache.py"),
                          "--cache-dir", str(warmed), "--no-module", "--deterministic",
                          "--ln-grad", "contract", *TINY],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| batch 3, contract |" in run.stdout
    cold = re.search(r"cold: [\d.]+ s for 1 first calls \((\d+) Inductor compiles", run.stdout)
    assert cold and int(cold.group(1)) >= 1, run.stdout[-2000:]
    assert re.search(r"fresh process: 0 Inductor compiles, [1-9]\d* cache hits", run.stdout), \
        run.stdout[-2000:]


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


# torch's own `import torch._dynamo` sets TORCHINDUCTOR_CACHE_DIR to its default: import
# that first, so that the snapshot tells what importing vitattn_bwd changes.
IMPORT_WITH_BAD_CACHE = """
import json, os, torch, torch._dynamo, torch._inductor.config
before = dict(os.environ)
import vitattn_bwd
from vitattn_bwd import cache
after = dict(os.environ)
changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
errors = []
for _ in range(2):
    try:
        cache.load_env_cache_once()
        errors.append(None)
    except RuntimeError as e:
        errors.append(str(e))
print(json.dumps({"changed": changed, "errors": errors,
                  "inductor_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


def test_import_with_a_bad_cache_variable_changes_nothing_and_the_first_load_raises(tmp_path):
    bad = tmp_path / "not-a-cache"
    bad.mkdir()
    run = subprocess.run([sys.executable, "-c", IMPORT_WITH_BAD_CACHE], capture_output=True,
                         text=True, env=_env(VITATTN_BWD_CACHE=str(bad)), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["changed"] == []                       # importing left os.environ alone
    message = f"{bad} is not a vitattn_bwd compile cache"
    assert [message in e for e in out["errors"]] == [True, True], out  # and again, later
    assert out["inductor_dir"] != str(bad)


BAD_CACHE_AT_THE_FORWARD = """
import json, torch
from vitattn_bwd import VisionAttentionBlock
block = VisionAttentionBlock(16, 2)
x = torch.randn(2, 5, 16, requires_grad=True)
try:
    y = block(x)
    print(json.dumps({"forward": "ran"}))
except RuntimeError as error:
    print(json.dumps({"forward": str(error)}))
"""


def test_a_bad_cache_variable_is_refused_in_the_first_forward(tmp_path):
    """On the CPU the forward compiles nothing: the first compile is the backward's, yet
    a bad VITATTN_BWD_CACHE is refused in the forward (nothing left for the backward)."""
    run = subprocess.run([sys.executable, "-c", BAD_CACHE_AT_THE_FORWARD],
                         capture_output=True, text=True,
                         env=_env(VITATTN_BWD_CACHE=str(tmp_path)), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert f"{tmp_path} is not a vitattn_bwd compile cache" in out["forward"], out


LOAD_GOOD_CACHE = """
import json, os, vitattn_bwd
from vitattn_bwd import cache
at_import = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
first = cache.load_env_cache_once()
inductor_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
os.environ[cache.CACHE_ENV] = "/nonexistent"           # read once: no effect now
second = cache.load_env_cache_once()
print(json.dumps({"at_import": at_import, "first": str(first), "second": second,
                  "inductor_dir": inductor_dir}))
"""


def test_env_cache_is_loaded_at_the_first_call_only(tmp_path):
    cache.write_fingerprint(tmp_path)
    run = subprocess.run([sys.executable, "-c", LOAD_GOOD_CACHE], capture_output=True,
                         text=True, env=_env(VITATTN_BWD_CACHE=str(tmp_path)), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["at_import"] != str(tmp_path.resolve())
    assert out == {"at_import": out["at_import"], "first": str(tmp_path.resolve()),
                   "second": None, "inductor_dir": str(tmp_path.resolve())}


def test_env_cache_unset_does_nothing(monkeypatch):
    monkeypatch.setattr(cache, "_env_done", False)
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    environ = dict(os.environ)
    assert cache.load_env_cache_once() is None
    assert dict(os.environ) == environ and cache._env_done


def test_env_cache_loads_once_under_concurrent_first_calls(monkeypatch):
    monkeypatch.setattr(cache, "_env_done", False)
    monkeypatch.setenv(cache.CACHE_ENV, "/some/cache")
    calls = []

    def slow_load(path):
        calls.append(path)
        time.sleep(0.05)                  # wide window for a second thread to slip in
        return Path(path)

    monkeypatch.setattr(cache, "load_compile_cache", slow_load)
    start, results = threading.Barrier(8), []

    def first_compile():
        start.wait()
        results.append(cache.load_env_cache_once())

    threads = [threading.Thread(target=first_compile) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["/some/cache"]
    assert sorted(map(str, results)) == ["/some/cache"] + ["None"] * 7


def _package_copy(tmp_path):
    copy = tmp_path / "vitattn_bwd"
    shutil.copytree(Path(cache.__file__).parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_template_sources_are_what_graph_and_inductor_import():
    sources = cache.template_sources()
    assert sources == cache._TEMPLATE_SOURCES
    for name in ("graph.py", "inductor.py", "softmax_bwd.py", "precision.py",
                 "kernels/softmax_bwd.py"):
        assert name in sources, name
    # every kernels module that inductor.py names (at the top or inside a function), read
    # with a regex rather than the ast walk under test
    package = Path(cache.__file__).parent
    text = (package / "inductor.py").read_text()
    kernels = {f"kernels/{name}.py" for name in
               re.findall(r"from \.kernels\.(\w+) import", text)
               + [n.split(" as ")[0].strip()
                  for names in re.findall(r"from \.kernels import ([\w, ]+)", text)
                  for n in names.split(",")]}
    assert kernels and kernels <= set(sources), (kernels, sources)
    # modules the compiled code does not import stay out
    for name in ("api.py", "module.py", "contract.py", "workloads.py", "__init__.py"):
        assert name not in sources, name


def test_touching_any_template_source_changes_the_tag(tmp_path):
    copy = _package_copy(tmp_path)
    base = cache.cache_key_tag(copy)
    assert base == cache.cache_key_tag()                  # same bytes, same tag
    for rel in cache.template_sources(copy):
        path = copy / rel
        original = path.read_bytes()
        path.write_bytes(original + b"\n# touched\n")
        assert cache.cache_key_tag(copy) != base, rel
        path.write_bytes(original)
    assert cache.cache_key_tag(copy) == base
    (copy / "module.py").write_bytes((copy / "module.py").read_bytes() + b"\n# touched\n")
    assert cache.cache_key_tag(copy) == base              # not compiled code


def test_a_new_module_imported_by_the_lowering_joins_the_tag(tmp_path):
    """Generic: a kernels module imported at the top of inductor.py and a module imported
    inside a function of softmax_bwd.py are followed without a list to update."""
    copy = _package_copy(tmp_path)
    (copy / "kernels" / "new_tiles.py").write_text("from ..extra_math import helper\n")
    (copy / "extra_math.py").write_text("def helper():\n    return 1\n")
    (copy / "late.py").write_text("X = 1\n")
    (copy / "inductor.py").write_text("from .kernels import new_tiles\n"
                                      + (copy / "inductor.py").read_text())
    (copy / "softmax_bwd.py").write_text((copy / "softmax_bwd.py").read_text()
                                            + "\n\ndef _late():\n    from .late import X\n")
    sources = cache.template_sources(copy)
    for rel in ("kernels/new_tiles.py", "extra_math.py", "late.py"):
        assert rel in sources, rel
        base = cache.cache_key_tag(copy)
        (copy / rel).write_text((copy / rel).read_text() + "# touched\n")
        assert cache.cache_key_tag(copy) != base, rel
