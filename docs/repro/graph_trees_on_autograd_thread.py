"""A reproduction attempt for issue 13's unexplained exits: Inductor's CUDA graph trees
(torch.compile mode="reduce-overhead") called from a custom autograd Function's backward,
which autograd runs on its own device thread, with calls on the main thread in between:
the pattern of vitattn_bwd's batch-1 module backward before v12 replaced the trees with
its own CUDA graphs (cuda_graphs.py). Upstream: pytorch issues 113809 and 123177, fixed
by PR 184357 (in torch 2.13, not in torch 2.11). Plain torch, no vitattn_bwd.

Variants (each child process runs one, with faulthandler on, so a segfault or a silent
exit shows as its return code and a Python stack):
  same    one compiled function, called by the forward (main thread), the backward
          (autograd's thread) and the main thread between steps;
  split   a compiled forward whose output (cloned out of the graph pool, as vitattn_bwd
          copied its graphs' outputs) the backward saves, and a separate compiled
          backward: vitattn_bwd's module before v12 (forward graph, saved tensors,
          backward graph on autograd's thread). Saving the pool tensor itself fails
          at once with graph trees' "accessing tensor output of CUDAGraphs that has
          been overwritten" (the backward is a new function to the tree; torch 2.11);
  sizes   split, cycling batch sizes 1, 2, 3, so every step records or replays another
          graph of the tree.

    python docs/repro/graph_trees_on_autograd_thread.py [--variants same split sizes]
        [--copies 2] [--steps 300] [--timeout 240] [--log-dir DIR]
"""
import argparse
import pathlib
import subprocess
import sys
import time

CHILD = r'''
import faulthandler
import sys

import torch

faulthandler.enable()
variant, steps = sys.argv[1], int(sys.argv[2])
S, E = 577, 1024


def project(activation, weight):
    return torch.relu(activation @ weight).sum(-1, keepdim=True) * activation


def project_backward(grad, saved, weight):
    return (grad * saved) @ weight.t() + saved


compiled_forward = torch.compile(project, mode="reduce-overhead")      # CUDA graph trees
compiled_backward = (compiled_forward if variant == "same"
                     else torch.compile(project_backward, mode="reduce-overhead"))


class Graphed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, weight):                            # the caller's thread
        output = compiled_forward(activation, weight).clone()   # out of the graph pool
        ctx.save_for_backward(output if variant != "same" else weight, weight)
        return output

    @staticmethod
    def backward(ctx, grad):                                          # autograd's thread
        saved, weight = ctx.saved_tensors
        if variant == "same":
            return compiled_backward(grad, weight), None
        return compiled_backward(grad, saved, weight), None


weight = torch.randn(E, E, device="cuda") / E ** 0.5
for step in range(steps):
    batch = 1 + step % 3 if variant == "sizes" else 1
    activation = torch.randn(batch, S, E, device="cuda", requires_grad=True)
    Graphed.apply(activation, weight).sum().backward()
    compiled_forward(torch.randn(batch, S, E, device="cuda"), weight)  # main thread between
    if step % 50 == 0:
        print(f"step {step}", flush=True)
torch.cuda.synchronize()
print("clean exit", flush=True)
'''


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["same", "split", "sizes"],
                        choices=["same", "split", "sizes"])
    parser.add_argument("--copies", type=int, default=2, help="processes per variant")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds, all runs")
    parser.add_argument("--log-dir", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    runs = []                                       # all children at once, one GPU
    for variant in args.variants:
        for copy in range(args.copies):
            runs.append((variant, copy, subprocess.Popen(
                [sys.executable, "-c", CHILD, variant, str(args.steps)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    deadline = time.monotonic() + args.timeout
    print("variant copy return-code last-line")
    for variant, copy, child in runs:
        try:
            output, _ = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
            code = child.returncode
        except subprocess.TimeoutExpired:
            child.kill()
            output, _ = child.communicate()
            code = "timeout"
        lines = output.strip().splitlines() or [""]
        if args.log_dir:
            (args.log_dir / f"{variant}_{copy}.txt").write_text(output)
        print(f"{variant} {copy} {code} {lines[-1][:120]!r}", flush=True)


if __name__ == "__main__":
    main()
