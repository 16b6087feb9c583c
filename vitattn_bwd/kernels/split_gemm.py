"""Triton device code of the split GEMM: C = A @ B for float32 A [M,K] and B [K,N] given
as (hi, lo) halves (fp16 halves of the operands scaled into fp16's range, precision.py),
three products per K slice, with two-level accumulation:

    for each BLOCK_K slice of K:
        partial = a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi     (tensor cores, from zero)
        acc    += partial                                     (float32 adds, rounded)
    C = acc * unscale[0] * unscale[1]

Why two levels: the tensor cores accumulate in float32 with truncation, so the error of
one accumulator over all of K grows with K and is biased (a cuBLAS fp16x3 GEMM at batch
32's K = 18,464 was 50-190x float32 SGEMM's error against float64, in slices of 128
1.3x). A and B are read through their strides (a transposed operand is a view); rows,
columns and K slices past the end are masked; each output element is written by one
program: deterministic. Element offsets are of OFFSET_DTYPE: tl.int64 only where an
operand reaches 2^31 elements (grad_kv from batch 1,818 at ViT-L/14-336), since int64
costs registers; with int32 the SASS is that of offsets written without a dtype.

`split_gemm_tile` and `grouped_tile` hold the algorithm; the raw kernel below and the
Inductor template (inductor.py pastes every non-kernel function of this file into it)
share them verbatim.
"""
import triton
import triton.language as tl


@triton.jit
def grouped_tile(program, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """(tile row, tile column) of a program: GROUP_M tile rows at a time sweep the tile
    columns, so consecutive programs share B's tiles in the L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = program // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    return (first_m + (program % (GROUP_M * tiles_n)) % group_rows,
            (program % (GROUP_M * tiles_n)) // group_rows)


@triton.jit
def split_gemm_tile(A_HI, A_LO, B_HI, B_LO, M, N, K, stride_am, stride_ak, stride_bk,
                    stride_bn, tile_m, tile_n, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    OFFSET_DTYPE: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile (tile_m, tile_n) of A @ B, unscaled."""
    rows = tile_m.to(OFFSET_DTYPE) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(OFFSET_DTYPE) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K).to(OFFSET_DTYPE)
    if OFFSET_DTYPE == tl.int64:                     # the step times a stride: no wrap
        k_step = tl.full([], BLOCK_K, tl.int64)
    else:
        k_step = BLOCK_K
    row_ok = (rows < M)[:, None]
    col_ok = (cols < N)[None, :]
    a_offsets = rows[:, None] * stride_am + ks[None, :] * stride_ak   # [BLOCK_M, BLOCK_K]
    b_offsets = ks[:, None] * stride_bk + cols[None, :] * stride_bn   # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_ok = ks < K - k_start
        a_mask = row_ok & k_ok[None, :]
        b_mask = k_ok[:, None] & col_ok
        a_hi = tl.load(A_HI + a_offsets, mask=a_mask, other=0.0)
        a_lo = tl.load(A_LO + a_offsets, mask=a_mask, other=0.0)
        b_hi = tl.load(B_HI + b_offsets, mask=b_mask, other=0.0)
        b_lo = tl.load(B_LO + b_offsets, mask=b_mask, other=0.0)
        # The slice's three products into a fresh accumulator, small terms first. Its
        # last dot adds into `partial`, not into zero, so Triton's combine pass (which
        # rewrites acc + dot(a, b, 0) as dot(a, b, acc)) leaves the float32 add alone.
        partial = tl.dot(a_lo, b_hi)
        partial = tl.dot(a_hi, b_lo, partial)
        partial = tl.dot(a_hi, b_hi, partial)
        acc += partial
        a_offsets += k_step * stride_ak
        b_offsets += k_step * stride_bk
    return acc


@triton.jit
def unscaled(acc, UNSCALE):
    """The tile with the operands' scales taken out, one factor after the other (exact,
    powers of two; split_gemm.unscale_of balances them, since their product may lie
    outside float32's range)."""
    return acc * tl.load(UNSCALE) * tl.load(UNSCALE + 1)


@triton.jit
def split_gemm_kernel(A_HI, A_LO, B_HI, B_LO, UNSCALE, C, M, N, K: tl.constexpr,
                      stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      OFFSET_DTYPE: tl.constexpr):
    """C [M,N] float32 (contiguous) = (A @ B) * UNSCALE[0] * UNSCALE[1]; grid: one
    program per tile.
    K is a constexpr here (the template passes it at run time): Triton 3.6's interpreter
    cannot loop to a run-time bound under numpy 2 (it calls int() on a 1-element
    array)."""
    tile_m, tile_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = split_gemm_tile(A_HI, A_LO, B_HI, B_LO, M, N, K, stride_am, stride_ak, stride_bk,
                          stride_bn, tile_m, tile_n, BLOCK_M, BLOCK_N, BLOCK_K, OFFSET_DTYPE)
    acc = unscaled(acc, UNSCALE)
    rows = tile_m.to(OFFSET_DTYPE) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tile_n.to(OFFSET_DTYPE) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(C + rows * N + cols, acc, mask=(rows < M) & (cols < N))
