"""The block's LayerNorm backward (plus the residual and the out-projection bias
gradient, which read the same rows), as PyTorch math and as one CUDA operator.

`layer_norm_backward` is the math of the graph's CPU path (float32 and float64; the
tests hold both it and the kernel to reference.layer_norm_backward in float64).
`fused_layer_norm_backward` is the operator the graph calls on CUDA: one pass of
kernels/layer_norm_bwd.py over the rows, which also sums the three column gradients as
per-program partials that are then added in a fixed order. It is a
`torch.library.triton_op`, so under torch.compile Inductor launches the Triton kernel
from its generated code like any of its own (public API; nothing of Inductor's private
API here).

    fused_layer_norm_backward(grad_output, part0, part1, part2, part3, unscale, x, x_mean,
                              x_var, ln_weight, norm_eps, exact)
        -> grad_x [B,S,E], grad_ln_weight [E], grad_ln_bias [E], grad_out_bias [E]

grad_x_norm, the gradient at the LayerNorm's output, arrives as the four GEMM outputs
[B*S,E] it is the sum of, ((part0 + part1) + (part2 + part3)) * unscale (graph.py's
bf16x3 products), or as two, (part0 + part1) * unscale, with part2 and part3 None (its
one-product path), so it is never written whole.
"""
from typing import NamedTuple, Optional

import torch
from torch.library import triton_op, wrap_triton


class LayerNormTiles(NamedTuple):
    """Launch configuration: a program takes `chunks` chunks of `rows_per_chunk` rows,
    one after the other, with `num_warps` warps."""
    rows_per_chunk: int
    chunks: int
    num_warps: int

    @property
    def rows_per_program(self):
        return self.rows_per_chunk * self.chunks


# Measured on the H200 (scripts/time_kernels.py --kernel layer_norm; the kernel alone,
# where docs/performance.md's "Components at batch 32" row has it in a whole call at
# 0.134 ms), at batch 32: 0.139 ms for the kernel
# (3.8 TB/s), 0.150 with its partial sums [3, 1154, E] added; 2 x 2 rows with 4 warps
# 0.143 / 0.171 (four times the partial sums), 2-4 x 8-16 rows 0.141-0.157 /
# 0.156-0.180. The chunks are a loop, so these tiles compile for sm_90 to 128 registers
# without spills (tests/test_kernel_resources.py). What Inductor made of the same math
# took 0.231-0.320 ms at batch 32.
TILES = LayerNormTiles(rows_per_chunk=4, chunks=4, num_warps=8)


def layer_norm_backward(grad_output, grad_x_norm, x, x_mean, x_var, ln_weight, norm_eps,
                        ln_grad):
    """LayerNorm's backward plus the residual: (grad_x, grad_ln_weight, grad_ln_bias).
    ln_grad "exact" is the true gradient, "contract" the benchmark's formula (its last
    term lacks 1/std)."""
    rstd = torch.rsqrt(x_var + norm_eps)                                       # [B,S,1]
    xhat = (x - x_mean) * rstd                                                 # [B,S,E]
    grad_xhat = grad_x_norm * ln_weight
    centered = grad_xhat - grad_xhat.mean(-1, keepdim=True)
    projection = xhat * (grad_xhat * xhat).mean(-1, keepdim=True)
    if ln_grad == "exact":
        grad_x = grad_output + (centered - projection) * rstd
    else:
        grad_x = grad_output + centered * rstd - projection
    return grad_x, (grad_x_norm * xhat).sum((0, 1)), grad_x_norm.sum((0, 1))


def launch(grad_output, part0, part1, part2, part3, unscale, x, x_mean, x_var, ln_weight,
           norm_eps, exact, tiles=TILES, launcher=lambda kernel: kernel):
    """Run the kernel: (grad_x [B,S,E], partial_sums [3, programs, E], one row per
    program of tiles.rows_per_program rows). `launcher` wraps the kernel (wrap_triton
    inside the operator)."""
    import triton

    from .kernels.layer_norm_bwd import layer_norm_bwd_kernel
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if grad_output.dtype != x.dtype:
        raise TypeError(f"grad_output must have x's dtype {x.dtype}, got "
                        f"{grad_output.dtype}")
    parts = 2 if part2 is None else 4
    if parts == 2:                      # not read: any tensor of the kernel's type
        part2 = part3 = part0
    B, S, E = x.shape
    grad_x = x.new_empty(B, S, E)               # row-major, as the kernel writes it
    programs = -(-B * S // tiles.rows_per_program)
    partial_sums = x.new_empty(3, programs, E, dtype=torch.float32)
    launcher(layer_norm_bwd_kernel)[(programs,)](
        grad_output.contiguous(), part0.contiguous(), part1.contiguous(), part2.contiguous(),
        part3.contiguous(), unscale, x.contiguous(), x_mean.contiguous(), x_var.contiguous(),
        ln_weight.contiguous(), grad_x, partial_sums, B * S, norm_eps, EMBED=E,
        BLOCK_E=triton.next_power_of_2(E), ROWS_PER_CHUNK=tiles.rows_per_chunk,
        CHUNKS=tiles.chunks, EXACT=exact, PARTS=parts, num_warps=tiles.num_warps)
    return grad_x, partial_sums


def _traceable(kernel):
    """wrap_triton(kernel), so that Inductor sees the kernel it traces; under Triton's
    interpreter (TRITON_INTERPRET=1, the CPU tests) the kernel itself, as torch 2.13's
    wrap_triton returns it, where torch 2.11's raises."""
    from triton.runtime.jit import JITFunction
    return wrap_triton(kernel) if isinstance(kernel, JITFunction) else kernel


@triton_op("vitattn_bwd::fused_layer_norm_backward", mutates_args=())
def fused_layer_norm_backward(grad_output: torch.Tensor, part0: torch.Tensor,
                              part1: torch.Tensor, part2: Optional[torch.Tensor],
                              part3: Optional[torch.Tensor],
                              unscale: torch.Tensor, x: torch.Tensor, x_mean: torch.Tensor,
                              x_var: torch.Tensor, ln_weight: torch.Tensor, norm_eps: float,
                              exact: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_x, partial_sums = launch(grad_output, part0, part1, part2, part3, unscale, x,
                                  x_mean, x_var, ln_weight, norm_eps, exact,
                                  launcher=_traceable)
    # three tensors of their own (not views of one [3,E] sum: they become three .grad)
    grad_ln_weight, grad_ln_bias, grad_out_bias = (sums.sum(0) for sums in partial_sums)
    return grad_x, grad_ln_weight, grad_ln_bias, grad_out_bias
