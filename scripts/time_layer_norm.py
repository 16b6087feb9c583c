"""The LayerNorm backward on the GPU: the fused kernel (layer_norm.py) at several launch
configurations against what Inductor makes of the same math (the four GEMM outputs
added, the row kernel, the sums over rows), checked against float64 and timed in one
call.

    PYTHONPATH=. python3 scripts/time_layer_norm.py [--batches 1 8 32] [--out DIR]

Median times with the L2 flushed (triton.testing.do_bench). Prints a table last.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import layer_norm  # noqa: E402
from vitattn_bwd.layer_norm import LayerNormTiles  # noqa: E402

S, E, EPS = 577, 1024, 1e-5
CANDIDATES = [LayerNormTiles(r, c, w) for r, c, w in (
    (4, 4, 8), (2, 2, 4), (2, 8, 4), (4, 8, 8), (2, 16, 4), (4, 16, 8), (8, 4, 8))]


def make_inputs(batch, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    x = randn(batch, S, E) * 2 + 0.5
    return (randn(batch, S, E), *(randn(batch * S, E) for _ in range(4)),
            torch.tensor(0.5, device="cuda"), x, x.mean(-1, keepdim=True),
            x.var(-1, unbiased=False, keepdim=True), randn(E))


def inductor_math(grad_output, p0, p1, p2, p3, unscale, x, x_mean, x_var, ln_weight):
    """The graph's math before the fused kernel (graph.py of session 8)."""
    grad_x_norm = (((p0 + p1) + (p2 + p3)) * unscale).view(x.shape)
    grad_x, grad_ln_weight, grad_ln_bias = layer_norm.layer_norm_backward(
        grad_output, grad_x_norm, x, x_mean, x_var, ln_weight, EPS, "contract")
    return grad_x, torch.stack([grad_ln_weight, grad_ln_bias, grad_output.sum((0, 1))])


def rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def main():
    import triton
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100,  # noqa: E731
                                               return_mode="median")
    compiled_math = torch.compile(inductor_math, dynamic=False)
    compiled_fused = torch.compile(
        lambda *t: layer_norm.fused_layer_norm_backward(*t, EPS, False), dynamic=True)
    table = []
    for batch in args.batches:
        inputs = make_inputs(batch)
        want = [t.double() for t in inductor_math(*(t.double() for t in inputs))]
        got = compiled_math(*inputs)
        table.append((batch, "inductor (old graph)", bench(lambda: compiled_math(*inputs)),
                      rel(got[0], want[0]), rel(got[1], want[1])))
        got = compiled_fused(*inputs)
        table.append((batch, f"fused, compiled {tuple(layer_norm.TILES)}",
                      bench(lambda: compiled_fused(*inputs)), rel(got[0], want[0]),
                      rel(torch.stack(got[1:]), want[1])))
        for tiles in CANDIDATES:
            grad_x, partial = layer_norm.launch(*inputs, EPS, False, tiles)
            errors = rel(grad_x, want[0]), rel(partial.sum(1), want[1])
            table.append((batch, f"fused {tuple(tiles)}",
                          bench(lambda: layer_norm.launch(*inputs, EPS, False, tiles)),
                          *errors))
            # with the sums of its partials ([3, programs, E]: more rows per program,
            # fewer of them)
            table.append((batch, f"fused {tuple(tiles)} + partials summed",
                          bench(lambda: layer_norm.launch(*inputs, EPS, False, tiles)[1]
                                .sum(1)), *errors))
    Path(args.out, "layer_norm.json").write_text(json.dumps(table, indent=1))
    print(f"{'batch':>5} {'variant':48} {'ms':>7} {'grad_x err':>10} {'sums err':>9}")
    for batch, name, ms, err_x, err_sums in table:
        print(f"{batch:5} {name:48} {ms:7.4f} {err_x:10.1e} {err_sums:9.1e}")


if __name__ == "__main__":
    main()
