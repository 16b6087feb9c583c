"""Host time of a torch.library operator pair with a register_autograd formula against a
plain torch.autograd.Function calling the same Python kernels (no-op CPU kernels, tiny
tensors; microseconds per call on one CPU core of the development machine)."""
import time

import torch

lib = torch.library.Library("probe_ag", "FRAGMENT")
lib.define("fwd(Tensor x, int n) -> (Tensor, Tensor)")
lib.define("bwd(Tensor g, Tensor x, Tensor a, Tensor lse, int n) -> Tensor")


def fwd(x, n):
    return x.new_empty(x.shape), x.new_empty(x.shape[:1])


def bwd(g, x, a, lse, n):
    return x.new_empty(x.shape)


lib.impl("fwd", fwd, "CPU")
lib.impl("bwd", bwd, "CPU")


def setup(ctx, inputs, output):
    x, ctx.n = inputs
    a, lse = output
    ctx.save_for_backward(x, a, lse)
    ctx.mark_non_differentiable(lse)


def backward(ctx, ga, _):
    x, a, lse = ctx.saved_tensors
    return torch.ops.probe_ag.bwd(ga, x, a, lse, ctx.n), None


torch.library.register_autograd("probe_ag::fwd", backward, setup_context=setup, lib=lib)


class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n):
        a, lse = fwd(x, n)
        ctx.save_for_backward(x, a, lse)
        ctx.n = n
        ctx.mark_non_differentiable(lse)
        return a, lse

    @staticmethod
    def backward(ctx, ga, _):
        x, a, lse = ctx.saved_tensors
        return bwd(ga, x, a, lse, ctx.n), None


x = torch.randn(4, 8, requires_grad=True)
g = torch.randn(4, 8)


def us_per_call(fn, n=3000):
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


with torch.no_grad():
    print("op no grad", us_per_call(lambda: torch.ops.probe_ag.fwd(x, 2)))
print("op fwd with grad", us_per_call(lambda: torch.ops.probe_ag.fwd(x, 2)))
print("op fwd+bwd", us_per_call(lambda: torch.ops.probe_ag.fwd(x, 2)[0].backward(g)))
print("Function fwd+bwd", us_per_call(lambda: F.apply(x, 2)[0].backward(g)))
print("bwd op alone", us_per_call(lambda: torch.ops.probe_ag.bwd(g, x, x, x, 2)))
print("mul fwd+bwd", us_per_call(lambda: (x * 2).backward(g)))
