"""Compile caches: a directory that a warm-up run fills (scripts/warmup_cache.py) and a
later process reuses, so training starts without Inductor's minutes of max-autotune.

The directory is an ordinary TORCHINDUCTOR_CACHE_DIR (FX graphs, AOTAutograd entries,
Triton binaries and autotune timings) plus a fingerprint file naming the torch, triton,
GPU and vitattn_bwd sources it was made with. Caches only serve the stack that made them,
so `load_compile_cache` refuses a directory whose fingerprint differs.

    vitattn_bwd.load_compile_cache("/path/to/cache")   # or VITATTN_BWD_CACHE=/path/...
"""
import hashlib
import json
import os
import pathlib

import torch

FINGERPRINT_FILE = "vitattn_bwd_cache.json"
CACHE_ENV = "VITATTN_BWD_CACHE"
_PACKAGE = pathlib.Path(__file__).parent
# Sources whose changes Inductor's FX graph cache would not notice (it hashes torch and
# its config, not our lowerings and templates).
_TEMPLATE_SOURCES = ("inductor.py", "kernels/softmax_bwd.py", "graph.py", "precision.py")


def cache_key_tag():
    """A tag that changes whenever our templates, lowering or graph change; compiles run
    under torch.compiler.config.cache_key_tag = this."""
    digest = hashlib.sha256()
    for name in _TEMPLATE_SOURCES:
        digest.update((_PACKAGE / name).read_bytes())
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
    """Point Inductor at `path` (created if needed) for this process. Call it before the
    first compile."""
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
