"""Triton device code for the block's LayerNorm backward, with its sums over rows.

One pass over the rows (tokens) of x [rows, E]. Per row, with xhat = (x - mean) * rstd
and the QKV input gradient given as the PARTS (4 or 2) GEMM outputs it is the sum of
(graph.py), scaled back by the power of two the upstream gradient was scaled by:

    grad_x_norm = ((part0 + part1) + (part2 + part3)) * unscale     (PARTS = 4)
    grad_x_norm = (part0 + part1) * unscale                         (PARTS = 2)
    grad_xhat   = grad_x_norm * ln_weight
    grad_x      = grad_output + (grad_xhat - mean(grad_xhat) - xhat * mean(grad_xhat * xhat)) * rstd
                                                                      (EXACT, the true gradient)
    grad_x      = grad_output + (grad_xhat - mean(grad_xhat)) * rstd - xhat * mean(grad_xhat * xhat)
                                                                      (the benchmark's formula)

and, summed over rows, grad_ln_weight = sum(grad_x_norm * xhat), grad_ln_bias =
sum(grad_x_norm) and grad_out_bias = sum(grad_output). Program p takes CHUNKS chunks of
ROWS_PER_CHUNK rows from row p * CHUNKS * ROWS_PER_CHUNK on, in a loop (not unrolled:
the registers do not grow with CHUNKS, which only sets how many partial sums there
are), and writes its three column sums to PARTIAL_SUMS [3, programs, E]; the caller adds
those rows in a fixed order. No atomics: the same bits on every run. This replaces what
Inductor made of the same math: a pointwise kernel adding the four parts into
grad_x_norm, the row kernel, and split reductions that read grad_x_norm, x and
grad_output again.
"""
import triton
import triton.language as tl


@triton.jit
def layer_norm_bwd_kernel(GRAD_OUTPUT, PART0, PART1, PART2, PART3, UNSCALE, X, X_MEAN,
                          X_VAR, LN_WEIGHT, GRAD_X, PARTIAL_SUMS, rows, norm_eps,
                          EMBED: tl.constexpr, BLOCK_E: tl.constexpr,
                          ROWS_PER_CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                          EXACT: tl.constexpr, PARTS: tl.constexpr):
    """GRAD_OUTPUT, PART0..3, X, GRAD_X [rows, EMBED]; X_MEAN, X_VAR [rows];
    LN_WEIGHT [EMBED]; UNSCALE a 1-element tensor; contiguous. float32, but for
    GRAD_OUTPUT, X, LN_WEIGHT and GRAD_X, which may be bf16 or fp16 (a bf16 / fp16
    block; the math is float32 all the same). PART2 and PART3 are not read when PARTS
    is 2."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < EMBED
    ln_weight = tl.load(LN_WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32)
    unscale = tl.load(UNSCALE)
    sum_grad_x_norm_xhat = tl.zeros([BLOCK_E], tl.float32)
    sum_grad_x_norm = tl.zeros([BLOCK_E], tl.float32)
    sum_grad_output = tl.zeros([BLOCK_E], tl.float32)
    for chunk in range(CHUNKS):
        row = ((program * CHUNKS + chunk) * ROWS_PER_CHUNK
               + tl.arange(0, ROWS_PER_CHUNK))                                 # [R]
        row_ok = row < rows
        offsets = row[:, None].to(tl.int64) * EMBED + cols[None, :]           # [R,BE]
        mask = row_ok[:, None] & col_ok[None, :]
        grad_x_norm = (tl.load(PART0 + offsets, mask=mask, other=0.0)
                       + tl.load(PART1 + offsets, mask=mask, other=0.0))
        if PARTS == 4:
            grad_x_norm += (tl.load(PART2 + offsets, mask=mask, other=0.0)
                            + tl.load(PART3 + offsets, mask=mask, other=0.0))
        grad_x_norm = grad_x_norm * unscale
        grad_output = tl.load(GRAD_OUTPUT + offsets, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(X_MEAN + row, mask=row_ok, other=0.0)
        # float32 (Inductor launches the operator with norm_eps as fp64, which would
        # promote everything after it)
        rstd = tl.rsqrt((tl.load(X_VAR + row, mask=row_ok, other=1.0) + norm_eps
                         ).to(tl.float32))
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        grad_xhat = grad_x_norm * ln_weight[None, :]
        mean_grad = tl.sum(grad_xhat, axis=1) / EMBED                          # [R]
        mean_grad_xhat = tl.sum(grad_xhat * xhat, axis=1) / EMBED
        if EXACT:
            grad_x_ln = (grad_xhat - mean_grad[:, None]
                         - xhat * mean_grad_xhat[:, None]) * rstd[:, None]
        else:
            grad_x_ln = ((grad_xhat - mean_grad[:, None]) * rstd[:, None]
                         - xhat * mean_grad_xhat[:, None])
        tl.store(GRAD_X + offsets, (grad_output + grad_x_ln).to(GRAD_X.dtype.element_ty),
                 mask=mask)
        sum_grad_x_norm_xhat += tl.sum(grad_x_norm * xhat, axis=0)
        sum_grad_x_norm += tl.sum(grad_x_norm, axis=0)
        sum_grad_output += tl.sum(grad_output, axis=0)
    programs = tl.num_programs(0)
    sums = PARTIAL_SUMS + program * EMBED + cols
    tl.store(sums, sum_grad_x_norm_xhat, mask=col_ok)
    tl.store(sums + programs * EMBED, sum_grad_x_norm, mask=col_ok)
    tl.store(sums + 2 * programs * EMBED, sum_grad_output, mask=col_ok)
