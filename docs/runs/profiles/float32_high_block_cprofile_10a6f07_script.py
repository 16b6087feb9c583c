"""cProfile of the float32 "high" VisionAttentionBlock step at batch 32 and 14 (host
side, GPU kept busy by a sleep); stats under $OUT, a short table on stdout."""
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "scripts")
sys.path.insert(0, ".")
from profile_host import host_us  # noqa: E402
from profile_kernels import module_step  # noqa: E402

out = Path(os.environ.get("OUT", "results"))
torch.set_float32_matmul_precision("high")
for batch in (14, 32):
    step = module_step(batch, False, stock=False)
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"batch {batch}: warm-up {time.perf_counter() - t0:.0f} s; host us "
          f"{host_us(step, 20):.0f}", flush=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(60)
    (out / f"f32_b{batch}_cprofile.txt").write_text(s.getvalue())
    lines = s.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "tottime" in line and "ncalls" in line)
    print("\n".join(lines[start:start + 12]), flush=True)
