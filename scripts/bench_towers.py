"""A Hugging Face CLIP vision tower as people train it, stock against swapped
(vitattn_bwd.integrations.hf.swap_attention, precision None), eager and under
torch.compile(model), in float32 and under bf16 autocast: every combination side by
side in one process, so that each ratio compares runs of the same machine.

    python scripts/bench_towers.py [--layers 12] [--batch-sizes 8 32]
                                   [--settings float32 autocast] [--rounds 3]

Per setting and batch size, one row per model: the median ms of a training step
(forward, backward of all parameters, zero_grad; inputs at fixed addresses), the spread
(min-max of the timed steps), the first step's seconds (compiles and autotuning
included; our compiles are cached across models of the same shapes, so the first model
that needs them pays for them), the GPU-busy ms per step (the union of the kernels'
intervals in a torch.profiler trace of 3 steps: wall time far above it means a
host-bound step), and the graph breaks torch._dynamo.explain finds in the model. The
ratios at the end are stock's time over the swapped one's (above 1: the swap is faster)
for eager against eager, compiled against compiled, and the swap eager against
torch.compile(stock). float32 runs at torch's "high" matmul precision (TF32 for the
stock tower's matmuls; our fused path's "high") unless --float32-precision says
otherwise. On a CPU a small tower (65 tokens, 128 wide) checks that the script runs.
"""
import argparse
import copy
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_module import compare_times, hf_step, hf_tower, step_times  # noqa: E402

from vitattn_bwd.integrations.hf import swap_attention  # noqa: E402


def gpu_busy_ms(step, steps=3):
    """ms per step during which at least one kernel ran (NaN off CUDA)."""
    if not torch.cuda.is_available():
        return float("nan")
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    intervals = sorted((e.time_range.start, e.time_range.end) for e in trace.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e3 / steps


def graph_breaks(model, pixels, amp):
    torch._dynamo.reset()
    with amp():
        return torch._dynamo.explain(model)(pixel_values=pixels).graph_break_count


def bench(setting, batch_sizes, layers, rounds, repeats, device):
    amp = functools.partial(torch.autocast, device, torch.bfloat16,
                            enabled=setting == "autocast")
    stock = hf_tower(device, layers)
    swapped = swap_attention(copy.deepcopy(stock))
    c = stock.config
    tokens = (c.image_size // c.patch_size) ** 2 + 1
    print(f"\n{setting}: {layers} layers, {tokens} tokens, {c.hidden_size} wide, "
          f"{c.num_attention_heads} heads, matmul precision "
          f"{torch.get_float32_matmul_precision()}")
    ratios = []
    for B in batch_sizes:
        torch.manual_seed(B)
        pixels = torch.randn(B, 3, c.image_size, c.image_size, device=device)
        grad = torch.randn(B, tokens, c.hidden_size, device=device)
        breaks = {"stock": graph_breaks(stock, pixels, amp),
                  "swapped": graph_breaks(swapped, pixels, amp)}
        torch._dynamo.reset()
        models = {"stock": stock, "swapped": swapped,
                  "compiled stock": torch.compile(stock, dynamic=False),
                  "compiled swapped": torch.compile(swapped, dynamic=False)}
        steps = {name: hf_step(model, pixels, grad, amp) for name, model in models.items()}
        first = {name: step_times(step, device, 1)[0] / 1e3
                 for name, step in steps.items()}
        times = compare_times(steps, device, rounds, repeats)
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"\n| batch {B} | median ms | spread ms | first step s | GPU-busy ms | "
              "graph breaks |")
        print("|---|---|---|---|---|---|")
        for name, t in times.items():
            print(f"| {name} | {medians[name]:.2f} | {min(t):.2f}-{max(t):.2f} | "
                  f"{first[name]:.1f} | {gpu_busy_ms(steps[name]):.2f} | "
                  f"{breaks[name.split()[-1]]} |", flush=True)
        ratios.append((B, medians["stock"] / medians["swapped"],
                       medians["compiled stock"] / medians["compiled swapped"],
                       medians["compiled stock"] / medians["swapped"]))
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="default: %(default)s")
    parser.add_argument("--batch-sizes", type=int, nargs="+",
                        help="default: 8 32 on CUDA, 2 on the CPU")
    parser.add_argument("--settings", nargs="+", default=["float32", "autocast"],
                        choices=("float32", "autocast"), help="default: %(default)s")
    parser.add_argument("--float32-precision", default="high",
                        choices=("highest", "high"), help="default: %(default)s")
    parser.add_argument("--rounds", type=int, default=3, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=4, help="default: %(default)s")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch_sizes = args.batch_sizes or ([8, 32] if device == "cuda" else [2])
    torch.set_float32_matmul_precision(args.float32_precision)
    summary = []
    for setting in args.settings:
        summary += [(setting, *row) for row in bench(setting, batch_sizes, args.layers,
                                                      args.rounds, args.repeats, device)]
    print("\n| setting | batch | eager: stock / swapped | compiled: stock / swapped | "
          "compiled stock / swapped eager |")
    print("|---|---|---|---|---|")
    for setting, B, eager, compiled, mixed in summary:
        print(f"| {setting} | {B} | {eager:.2f}x | {compiled:.2f}x | {mixed:.2f}x |")


if __name__ == "__main__":
    main()
