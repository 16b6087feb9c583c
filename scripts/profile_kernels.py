"""Where the time goes: CUDA kernels ranked by total time, under torch.profiler, for one
backward at a contract batch size, or (--module) for one VisionAttentionBlock training
step (forward + backward), with the kernels grouped by kind.

    python scripts/profile_kernels.py --batch 32 [--module] [--trace trace.json]
"""
import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import VisionAttentionBlock, contract  # noqa: E402
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
    if "multi_tensor_apply" in name or "memcpy" in lower:
        return "CUDA-graph input and output copies"
    if name.startswith("triton_"):
        return "Inductor's fused kernels (splits, copies, sums)"
    if "CUDAFunctor_add" in name:
        return "autograd's gradient accumulation"
    return "other"


def module_step(batch):
    torch.manual_seed(0)
    block = VisionAttentionBlock().cuda()
    x = torch.randn(batch, 577, 1024, device="cuda", requires_grad=True)
    grad = torch.randn_like(x)
    return lambda: block(x).backward(grad)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--module", action="store_true",
                        help="a VisionAttentionBlock fwd+bwd step instead of the contract")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--trace", type=Path)
    args = parser.parse_args()
    if args.module:
        step = module_step(args.batch)
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
