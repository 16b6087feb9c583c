"""Prototype, not package code (session 10): P tiles staged in shared memory for the
Gluon attention core, the pieces a producer-warp design would reuse.

What was measured (H200, batch 32, raw kernels; docs/runs/kernels/core_gluon_staged_p_s10.json):
the consumer warpgroup itself filling a NUM_STAGES-deep ring of P tiles by cp.async
(NUM_STAGES - 1 tiles ahead, in the commit groups of the k / v or dO / q rings) and
loading each tile from it into the wgmma accumulator layout was slower than loading P
straight into registers one tile ahead: rows 0.66-0.76 ms against 0.58, cols 0.81-0.84
against 0.67, at 2-4 stages and L2 prefetch distances 0-6. The copies took as many
instructions as the loads they replaced (LDGSTS.E, 4 bytes: P's 577-float rows allow no
wider copy) and added the shared-memory loads (LDS.64 in the rows pass, LDS in the cols
pass). With a producer warp issuing the copies (gl.warp_specialize, see
warp_specialized_p_stream.py), the consumers would keep only the shared-memory loads:
8 LDS.64 per thread per 64 x 32 tile in the rows pass, against 16 LDG.E today.

The layouts below compile for sm_90 (triton 3.6) and are free of bank conflicts for
those loads; PaddedSharedLayout did not lower on the NVIDIA backend ("unknown layout").
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.constexpr_function
def staged_p_layout(keys_along_rows):
    """The shared layout of a staged float32 P tile: keys contiguous (dim 1 in the rows
    pass's [BLOCK_M, BLOCK_N] tile; dim 0 in the cols pass's [BLOCK_N, BLOCK_M] P^T
    tile), groups of 8 keys swizzled. The rows pass's threads read pairs of keys from 4
    rows at a time (a phase per row), the cols pass's one key of 8 from queries 0, 2, 4,
    6 (a phase per two queries)."""
    if keys_along_rows:
        return gl.SwizzledSharedLayout(vec=8, per_phase=2, max_phase=4, order=[0, 1])
    return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])


@gluon.constexpr_function
def staged_p_copy_layout(rows, cols, keys_along_rows, num_warps):
    """The layout of the cp.async copies of a P tile: a warp's threads along the keys
    (contiguous in HBM), the warps across the other dimension."""
    if keys_along_rows:
        return gl.BlockedLayout([1, 1], [min(rows, 32), 32 // min(rows, 32)],
                                [1, num_warps], [0, 1])
    return gl.BlockedLayout([1, 1], [32 // min(cols, 32), min(cols, 32)], [num_warps, 1],
                            [1, 0])


@gluon.jit
def copy_p_tile(smem, base, row_start, col_start, SEQ_LEN: gl.constexpr, ROWS: gl.constexpr,
                COLS: gl.constexpr, KEYS_ALONG_ROWS: gl.constexpr, num_warps: gl.constexpr):
    """cp.async of a P tile into `smem` [ROWS, COLS] (staged_p_layout), 4 bytes per
    element, from indices clamped into the matrix (as the package kernels' register
    loads): element (i, j) is P[row_start + i, col_start + j], or with KEYS_ALONG_ROWS
    (the cols pass's P^T) P[col_start + j, row_start + i]. A consumer then reads it with
    smem.load(<the wgmma accumulator layout>) after the copy's wait."""
    layout: gl.constexpr = staged_p_copy_layout(ROWS, COLS, KEYS_ALONG_ROWS, num_warps)
    rows = gl.minimum(row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)),
                      SEQ_LEN - 1)
    cols = gl.minimum(col_start + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout)),
                      SEQ_LEN - 1)
    if KEYS_ALONG_ROWS:
        offsets = rows[:, None] + cols[None, :] * SEQ_LEN
    else:
        offsets = rows[:, None] * SEQ_LEN + cols[None, :]
    async_copy.async_copy_global_to_shared(smem, base + offsets)
