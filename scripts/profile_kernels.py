"""Where the time goes: one backward at a contract batch size under torch.profiler,
CUDA kernels ranked by total time.

    python scripts/profile_kernels.py --batch 32 [--trace trace.json]
"""
import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import contract  # noqa: E402
from vitattn_bwd.workloads import make_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--trace", type=Path)
    args = parser.parse_args()
    inputs = tuple(make_inputs(args.batch, device="cuda").values())
    for _ in range(3):
        contract.run(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            contract.run(*inputs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                    max_name_column_width=90))
    if args.trace:
        prof.export_chrome_trace(str(args.trace))


if __name__ == "__main__":
    main()
