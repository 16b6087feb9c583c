"""A reproduction attempt for issue 13's unexplained exit: Inductor's CUDA graph trees
(torch.compile mode="reduce-overhead") called from a custom autograd Function's backward,
which autograd runs on its own device thread, with calls of the same compiled function
on the main thread in between; the pattern of vitattn_bwd's batch-1 module backward
before v12 replaced the trees with its own CUDA graphs (cuda_graphs.py). Upstream:
pytorch issues 113809 and 123177, fixed by PR 184357 (not in torch 2.11).

Each trial runs in a child process with faulthandler on, so a segfault or a silent exit
shows as the child's return code. Prepared in session 6, not yet run on a GPU.

    python docs/repro/graph_trees_on_autograd_thread.py [--trials 5] [--steps 200]
"""
import argparse
import subprocess
import sys

CHILD = r'''
import faulthandler
import sys

import torch

faulthandler.enable()
S, E = 577, 1024


def step_fn(activation, weight):
    return torch.relu(activation @ weight).sum(-1, keepdim=True) * activation


compiled = torch.compile(step_fn, mode="reduce-overhead")           # CUDA graph trees


class GraphedBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, weight):                            # the caller's thread
        ctx.save_for_backward(weight)
        return compiled(activation, weight)

    @staticmethod
    def backward(ctx, grad):                                          # autograd's thread
        (weight,) = ctx.saved_tensors
        return compiled(grad, weight), None


weight = torch.randn(E, E, device="cuda") / E ** 0.5
for _ in range(int(sys.argv[1])):
    activation = torch.randn(1, S, E, device="cuda", requires_grad=True)
    GraphedBoth.apply(activation, weight).sum().backward()
    compiled(torch.randn(1, S, E, device="cuda"), weight)            # main thread between
torch.cuda.synchronize()
print("clean exit", flush=True)
'''


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    for trial in range(args.trials):
        child = subprocess.run([sys.executable, "-c", CHILD, str(args.steps)],
                               capture_output=True, text=True)
        tail = (child.stdout + child.stderr).strip().splitlines()[-3:]
        print(f"trial {trial}: return code {child.returncode}; last lines: {tail}",
              flush=True)


if __name__ == "__main__":
    main()
