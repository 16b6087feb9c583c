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
import time

import torch

from harness import host_us, module_step
from vitattn_bwd import contract, routing
from vitattn_bwd.workloads import make_inputs


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
