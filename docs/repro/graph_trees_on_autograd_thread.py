"""A reproduction of issue 13's unexplained exits (results: docs/repro/README.md).

Inductor's CUDA graph trees (torch.compile mode="reduce-overhead") are called from a
custom autograd Function's backward, which autograd runs on its own device thread, in
some variants with calls on the main thread in between: the pattern of vitattn_bwd's
batch-1 module backward before v12 replaced the trees with its own CUDA graphs
(cuda_graphs.py). Plain torch, no vitattn_bwd. On the H200 with torch 2.11, "phases"
dies of a segfault in every process and "phases_main_import" never does. Upstream:
pytorch issues 113809 and 123177, fixed by PR 184357 (in torch 2.13, not in 2.11).

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
          graph of the tree;
  first_in_backward
          an eager forward and one compiled function, first called (so the trees first
          imported and set up) in the backward on autograd's thread, then also on the
          main thread between steps: vitattn_bwd v6-v9, whose forward was eager;
  phases  first_in_backward without main-thread calls, then bench_module's move from
          batch 1 to batch 8: everything freed, garbage collected, cache emptied;
  phases_main_import
          phases, after importing the trees on the main thread first (so their
          thread-local state is set up there, as torch 2.11 expects).

    python docs/repro/graph_trees_on_autograd_thread.py [--variants same split sizes ...]
        [--copies 2] [--steps 300] [--timeout 240] [--log-dir DIR]
"""
import argparse
import pathlib
import subprocess
import sys
import time

CHILD = r'''
import faulthandler
import gc
import sys

import torch

faulthandler.enable()
variant, steps = sys.argv[1], int(sys.argv[2])
S, E = 577, 1024
if variant == "phases_main_import":          # the trees' thread-local state made here
    import torch._inductor.cudagraph_trees  # noqa: F401
    variant = "phases"
# first_in_backward, phases: the forward is eager, so the trees are first imported and
# first run on autograd's thread (vitattn_bwd v6: eager forward, compiled backward)
compiled_forward_used = variant in ("same", "split", "sizes")
main_thread_calls = variant != "phases"


def project(activation, weight):
    return torch.relu(activation @ weight).sum(-1, keepdim=True) * activation


def project_backward(grad, saved, weight):
    return (grad * saved) @ weight.t() + saved


compiled_forward = torch.compile(project, mode="reduce-overhead")      # CUDA graph trees
compiled_backward = (compiled_forward if variant in ("same", "first_in_backward")
                     else torch.compile(project_backward, mode="reduce-overhead"))


class Graphed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, weight):                            # the caller's thread
        if compiled_forward_used:
            output = compiled_forward(activation, weight).clone()   # out of the graph pool
        else:
            output = project(activation, weight)
        ctx.save_for_backward(output, weight)
        return output

    @staticmethod
    def backward(ctx, grad):                                          # autograd's thread
        saved, weight = ctx.saved_tensors
        if compiled_backward is compiled_forward:
            return compiled_backward(grad, weight), None
        return compiled_backward(grad, saved, weight), None


def run(batches, weight):
    for step in range(steps):
        batch = batches[step % len(batches)]
        activation = torch.randn(batch, S, E, device="cuda", requires_grad=True)
        Graphed.apply(activation, weight).sum().backward()
        if main_thread_calls:                                         # main thread between
            compiled_forward(torch.randn(batch, S, E, device="cuda"), weight)
        if step % 100 == 0:
            print(f"batch {batch} step {step}", flush=True)


weight = torch.randn(E, E, device="cuda") / E ** 0.5
run((1, 2, 3) if variant == "sizes" else (1,), weight)
if variant == "phases":          # bench_module's move from batch 1 to batch 8
    del weight
    gc.collect()
    torch.cuda.empty_cache()
    run((8,), torch.randn(E, E, device="cuda") / E ** 0.5)
torch.cuda.synchronize()
print("clean exit", flush=True)
'''


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    variants = ["same", "split", "sizes", "first_in_backward", "phases",
                "phases_main_import"]
    parser.add_argument("--variants", nargs="+", default=variants, choices=variants)
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
