"""Compile caches: a directory that a warm-up run fills (scripts/warmup_cache.py) and a
later process reuses, so training starts without Inductor's minutes of max-autotune.

The directory is an ordinary TORCHINDUCTOR_CACHE_DIR (FX graphs, AOTAutograd entries,
Triton binaries and autotune timings) plus a fingerprint file naming the torch, triton,
GPU and vitattn_bwd sources it was made with. Caches only serve the stack that made them,
so `load_compile_cache` refuses a directory whose fingerprint differs.

    vitattn_bwd.load_compile_cache("/path/to/cache")   # or VITATTN_BWD_CACHE=/path/...

VITATTN_BWD_CACHE is read at the fused path's first forward (forward_graph calls
load_env_cache_once, as graph.compile_graph does before any compile), not at import:
importing the package changes nothing, and a bad cache is refused in the forward, not
later in the backward. Loading a cache, by either way, is process-wide by nature: it
sets TORCHINDUCTOR_CACHE_DIR for the process (the user's other compiles use the
directory too) and unsets TRITON_CACHE_DIR, so that Triton's binaries come from the
cache's own triton folder, as Inductor derives it.
"""
import ast
import functools
import hashlib
import json
import os
import pathlib
import threading

import torch

FINGERPRINT_FILE = "vitattn_bwd_cache.json"
CACHE_ENV = "VITATTN_BWD_CACHE"
_PACKAGE = pathlib.Path(__file__).parent
# The modules whose code is compiled (graph.py, forward_graph.py: the traced math) or
# lowers it (inductor.py: templates and lowerings). Inductor's FX graph cache hashes torch
# and its config, not our sources, so the tag below hashes these and every module of ours
# they import.
_COMPILED_ROOTS = ("forward_graph.py", "graph.py", "inductor.py")


def _module_file(package_dir, parts):
    """The file of package-relative module `parts` (a module or a subpackage's
    __init__.py), or None if there is none. The package's own __init__ is not ours to
    follow (it imports the public API, not the compiled code)."""
    if not parts:
        return None
    for rel in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
        if (package_dir / rel).is_file():
            return rel
    return None


def _imported_files(package_dir, rel):
    """Package-relative files that the module at `rel` imports, anywhere in its body
    (imports inside functions count: they run at trace or lowering time), read with ast
    (nothing is executed). Subpackages bring their __init__.py."""
    parts = rel[:-len(".py")].split("/")
    package = parts[:-1]                  # the package this module's relative imports start at
    tree = ast.parse((package_dir / rel).read_bytes(), filename=rel)
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(package):
                    continue              # beyond the top package: not ours
                base = package[:len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == _PACKAGE.name:
                base = []
                node = ast.ImportFrom(module=".".join(node.module.split(".")[1:]) or None,
                                      names=node.names, level=1)
            else:
                continue
            module = base + (node.module.split(".") if node.module else [])
            targets.append(module)
            targets.extend(module + [alias.name] for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names = alias.name.split(".")
                if names[0] == _PACKAGE.name:
                    targets.append(names[1:])
    found = []
    for module in targets:
        for depth in range(1, len(module) + 1):       # parent packages' __init__ run too
            file = _module_file(package_dir, module[:depth])
            if file and (depth == len(module) or file.endswith("__init__.py")):
                found.append(file)
    return found


def template_sources(package_dir=None):
    """The package's source files (relative paths, sorted) whose change must change the
    cache-key tag: forward_graph.py, graph.py and inductor.py and, transitively, every
    module of the package they import (softmax_bwd.py, precision.py, the kernels,
    ...)."""
    package_dir = pathlib.Path(package_dir or _PACKAGE)
    seen, todo = set(), [r for r in _COMPILED_ROOTS if (package_dir / r).is_file()]
    while todo:
        rel = todo.pop()
        if rel not in seen:
            seen.add(rel)
            todo.extend(_imported_files(package_dir, rel))
    return tuple(sorted(seen))


_TEMPLATE_SOURCES = template_sources()


def cache_key_tag(package_dir=None):
    """A tag that changes whenever our templates, lowering or graph (or anything of ours
    they import) change; every compile's FX-cache key carries it (inductor.CacheKeyTag).
    For this package it is read once per process: the sources that run are the ones
    imported, and a file edited on disk mid-process must not give the process's later
    compiles (or the fingerprint) a tag that the earlier ones did not have."""
    if package_dir is None:
        return _own_tag()
    return _tag_of(pathlib.Path(package_dir), template_sources(package_dir))


@functools.cache
def _own_tag():
    return _tag_of(_PACKAGE, _TEMPLATE_SOURCES)


def _tag_of(package_dir, sources):
    digest = hashlib.sha256()
    for name in sources:
        digest.update((package_dir / name).read_bytes())
    return "vitattn_bwd-" + digest.hexdigest()[:16]


def fingerprint():
    """What a cache is only valid for."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"torch": torch.__version__, "triton": triton_version, "device": device,
            "vitattn_bwd": cache_key_tag()}


def use_cache_dir(path):
    """Point Inductor at `path` (created if needed) for this process: sets
    TORCHINDUCTOR_CACHE_DIR and unsets TRITON_CACHE_DIR (Inductor then keeps Triton's
    binaries under `path`). Call it before the first compile."""
    path = pathlib.Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ.pop("TRITON_CACHE_DIR", None)       # Inductor derives it from the above
    return path


def write_fingerprint(path):
    (pathlib.Path(path) / FINGERPRINT_FILE).write_text(json.dumps(fingerprint(), indent=1))


def load_compile_cache(path):
    """Use a cache directory made by scripts/warmup_cache.py. Raises RuntimeError if it
    was made by another torch, triton, GPU or vitattn_bwd version."""
    path = pathlib.Path(path)
    stamp = path / FINGERPRINT_FILE
    if not stamp.is_file():
        raise RuntimeError(f"{path} is not a vitattn_bwd compile cache (no {FINGERPRINT_FILE};"
                           " make one with scripts/warmup_cache.py)")
    made_with, here = json.loads(stamp.read_text()), fingerprint()
    differences = {k: (made_with.get(k), here[k]) for k in here if made_with.get(k) != here[k]}
    if differences:
        detail = ", ".join(f"{k}: cache {a!r} vs here {b!r}" for k, (a, b) in differences.items())
        raise RuntimeError(f"compile cache {path} was made for another stack ({detail}); "
                           "run scripts/warmup_cache.py again here")
    return use_cache_dir(path)


_env_lock = threading.Lock()
_env_done = False


def load_env_cache_once():
    """Load the cache that VITATTN_BWD_CACHE names, once per process, at the fused path's
    first forward or compile (forward_graph.attention_block_forward and
    graph.compile_graph call this). Does nothing when the variable is unset. Raises the
    RuntimeError of load_compile_cache for a bad cache, and again at every later call
    until a load succeeds. Thread-safe. Returns the cache directory, or None."""
    global _env_done
    if _env_done:
        return None
    with _env_lock:
        if _env_done:
            return None
        path = os.environ.get(CACHE_ENV)
        loaded = load_compile_cache(path) if path else None
        _env_done = True
        return loaded
