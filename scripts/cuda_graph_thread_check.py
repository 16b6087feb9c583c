"""Do CUDA graph trees run on autograd's worker thread on this torch? (issue 13)

    PYTHONPATH=. python3 scripts/cuda_graph_thread_check.py

Two checks, each in a process of its own (exit code and stderr tail reported):
  plain  a custom autograd.Function whose backward calls a torch.compile'd
         mode="reduce-overhead" function: CUDA graph trees on autograd's thread, plain
         torch only;
  ours   VisionAttentionBlock (577 tokens, 1024 wide, 16 heads, batch $B or 1) with its
         backward FORCED to run as a CUDA graph on autograd's thread (graph.uses_cuda_graph
         replaced), 20 steps, every step's x.grad bitwise equal to the first; the last line
         prints the norm of that gradient.
Without pytorch PR 184357 (torch 2.11) nothing serializes graph capture across threads:
a clean run does not show the race is absent, only that it did not strike here.
"""
import faulthandler
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20


def plain():
    import torch
    square_relu = torch.compile(lambda a, b: torch.relu(a @ b) * 2.0,
                                mode="reduce-overhead", fullgraph=True)

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return square_relu(grad, b.t()).clone(), square_relu(a.t(), grad).clone()

    for step in range(STEPS):
        a = torch.randn(256, 256, device="cuda", requires_grad=True)
        b = torch.randn(256, 256, device="cuda", requires_grad=True)
        Product.apply(a, b).sum().backward()
        torch.cuda.synchronize()
        print("step", step, "ok", flush=True)
    print("PLAIN DONE", flush=True)


def ours():
    import torch
    sys.path.insert(0, str(ROOT))
    from vitattn_bwd import VisionAttentionBlock, graph
    graph.uses_cuda_graph = lambda device_type, bucket: (
        device_type == "cuda" and (bucket is None or bucket[1] <= graph.CUDA_GRAPH_MAX_BATCH))
    torch.manual_seed(0)
    block = VisionAttentionBlock(1024, 16).cuda()
    first = None
    for step in range(STEPS):
        torch.manual_seed(1)
        x = torch.randn(int(os.environ.get("B", 1)), 577, 1024, device="cuda",
                        requires_grad=True)
        block(x).square().sum().backward()
        torch.cuda.synchronize()
        first = x.grad.clone() if first is None else first
        assert torch.equal(x.grad, first), step
        print("step", step, "ok", flush=True)
    print("OURS DONE, |x.grad| =", first.norm().item(), flush=True)


def main():
    faulthandler.enable()
    if len(sys.argv) > 1:
        {"plain": plain, "ours": ours}[sys.argv[1]]()
        return
    for mode in ("plain", "ours"):
        run = subprocess.run([sys.executable, __file__, mode], capture_output=True,
                             text=True, timeout=280)
        print(f"=== {mode}: rc={run.returncode}")
        print("stdout tail:", run.stdout[-600:])
        print("stderr tail:", run.stderr[-2500:])


if __name__ == "__main__":
    main()
