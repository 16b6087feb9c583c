"""Where the time goes: CUDA kernels ranked by total time, under torch.profiler, for one
backward at a contract batch size, or (--module) for one VisionAttentionBlock training
step (forward + backward), with the kernels grouped by kind; --autocast runs the
module's forward under torch.autocast(bfloat16), --stock profiles the stock block
(LayerNorm, Linear, SDPA, Linear) instead of ours.

    python scripts/profile_kernels.py --batch 32 [--module [--autocast] [--stock]
        [--float32-precision high]] [--trace trace.json]
"""
import contextlib
import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import VisionAttentionBlock, contract, reference  # noqa: E402
from vitattn_bwd.workloads import make_inputs  # noqa: E402


def group_of(name):
    """The kind of a CUDA kernel, from its name."""
    lower = name.lower()
    for attention_pass in ("rows", "cols"):               # our templates, Gluon kernels
        if f"softmax_bwd_{attention_pass}" in name and (
                name.startswith("triton_tem_") or name.endswith("_kernel")):
            return f"attention core: {attention_pass} pass"
    if name.startswith("layer_norm_bwd_kernel"):
        return "LayerNorm backward and sums over rows (fused kernel)"
    if name.startswith("attention_fwd_kernel"):
        return "attention forward"
    if any(fragment in lower for fragment in ("nvjet", "gemm", "cutlass")):
        return "GEMMs"
    if "flash" in lower or "fmha" in lower:
        return "torch's attention (flash / cuDNN)"
    if "multi_tensor_apply" in name or "memcpy" in lower:
        return "CUDA-graph input and output copies"
    if name.startswith("triton_"):
        return "Inductor's fused kernels (splits, copies, sums)"
    if "CUDAFunctor_add" in name:
        return "autograd's gradient accumulation"
    return "other"


def module_step(batch, autocast, stock):
    torch.manual_seed(0)
    block = VisionAttentionBlock().cuda()
    model = reference.ReferenceBlock(block) if stock else block
    x = torch.randn(batch, 577, 1024, device="cuda", requires_grad=True)
    grad = torch.randn_like(x)
    region = (lambda: torch.autocast("cuda", torch.bfloat16)) if autocast else \
        contextlib.nullcontext

    def step():
        with region():
            y = model(x)
        y.backward(grad)
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--module", action="store_true",
                        help="a VisionAttentionBlock fwd+bwd step instead of the contract")
    parser.add_argument("--autocast", action="store_true",
                        help="--module: the forward under torch.autocast(bfloat16)")
    parser.add_argument("--stock", action="store_true",
                        help="--module: the stock block instead of ours")
    parser.add_argument("--float32-precision", choices=("highest", "high"),
                        default="highest", help="--module: torch's float32 matmul "
                        "precision for the run (the block follows it; \"high\": TF32 for "
                        "--stock), default %(default)s")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--trace", type=Path)
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.float32_precision)
    if args.module:
        step = module_step(args.batch, args.autocast, args.stock)
    else:
        inputs = tuple(make_inputs(args.batch, device="cuda").values())
        step = lambda: contract.run(*inputs)                          # noqa: E731
    calls = 5
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                    max_name_column_width=90))
    groups, kernels = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            groups[group_of(event.name)] += event.device_time / 1e3 / calls
            kernels[(group_of(event.name), event.name)] += event.device_time / 1e3 / calls
    print("| group | kernel | ms per call |\n|---|---|---|")
    for (group, name), ms in kernels.most_common():
        print(f"| {group} | {name[:160]} | {ms:.4f} |")
    print("| group | ms per call |\n|---|---|")
    for group, ms in groups.most_common():
        print(f"| {group} | {ms:.3f} |")
    print(f"| busy | {sum(groups.values()):.3f} |")
    if args.trace:
        prof.export_chrome_trace(str(args.trace))


if __name__ == "__main__":
    main()
