"""Where the host time of a contract call goes: cProfile over calls made while the GPU
is kept busy (so no call waits for it), the functions ranked by their own time, and the
host time per call.

    PYTHONPATH=. python3 scripts/profile_host.py --batch 23 [--calls 20] [--rows 30]
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import contract  # noqa: E402
from vitattn_bwd.workloads import make_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=23)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    inputs = tuple(make_inputs(args.batch, device="cuda").values())
    for _ in range(3):                                       # compile, warm up
        contract.run(*inputs)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))              # GPU work queued ahead of the profiled calls
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(args.calls):
        contract.run(*inputs)
    profiler.disable()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(args.rows)
    print(stream.getvalue())
    print(f"batch {args.batch}: host {elapsed / args.calls * 1e6:.0f} us per call "
          f"(under cProfile)")


if __name__ == "__main__":
    main()
