"""Where the host time of a contract call goes: cProfile over calls made while the GPU
is kept busy (so no call waits for it), the functions ranked by their own time, and the
host time per call; --module: a VisionAttentionBlock training step (forward, under
torch.autocast(bfloat16) with --autocast, and backward) instead, whose host time is
also measured without cProfile, beside the stock block's. --our-attention-from N sets
routing.OUR_ATTENTION_MIN_BATCH for the run: under autocast the block's stock route
takes deterministic_sdpa's attention from N images on (N <= --batch to profile it).

    PYTHONPATH=. python3 scripts/profile_host.py --batch 23 [--calls 20] [--rows 30]
                                                 [--module [--autocast]]
                                                 [--our-attention-from N]
                                                 [--float32-precision high]
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

from profile_kernels import module_step  # noqa: E402  (beside this script)
from vitattn_bwd import contract, routing  # noqa: E402
from vitattn_bwd.workloads import make_inputs  # noqa: E402


def host_us(step, calls, sleep_cycles=int(5e8), tries=4):
    """Host time per call of step(), with the GPU kept busy ahead of the calls by a sleep
    kernel. A timing counts only if that sleep was still running when the last call
    returned; otherwise some call waited for the GPU (the sleep was too short, or the
    calls' kernels filled the launch queue, which blocks the host until the GPU drains
    it) and it is timed again with half the calls and twice the sleep. NaN if no try
    was clean."""
    for _ in range(3):                                       # compile, warm up
        step()
    for _ in range(tries):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        sleep_done = torch.cuda.Event()
        sleep_done.record()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        elapsed = time.perf_counter() - start
        caught_up = sleep_done.query()                   # the GPU got past the sleep
        torch.cuda.synchronize()
        if not caught_up:
            return elapsed / calls * 1e6
        calls, sleep_cycles = max(1, calls // 2), 2 * sleep_cycles
    return float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=23)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--autocast", action="store_true")
    parser.add_argument("--float32-precision", choices=("highest", "high"),
                        default="highest",
                        help="torch.set_float32_matmul_precision for the whole run")
    parser.add_argument("--our-attention-from", type=int,
                        default=routing.OUR_ATTENTION_MIN_BATCH,
                        help="routing.OUR_ATTENTION_MIN_BATCH for the run")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.float32_precision)
    routing.OUR_ATTENTION_MIN_BATCH = args.our_attention_from
    if args.module:
        step = module_step(args.batch, args.autocast, stock=False)
        for name, model_step in (("ours", step),
                                 ("stock", module_step(args.batch, args.autocast,
                                                       stock=True))):
            print(f"{name}: host {host_us(model_step, args.calls):.0f} us per step")
    else:
        inputs = tuple(make_inputs(args.batch, device="cuda").values())
        step = lambda: contract.run(*inputs)                          # noqa: E731
    for _ in range(3):                                       # compile, warm up
        step()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))              # GPU work queued ahead of the profiled calls
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(args.calls):
        step()
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
