"""Gluon device code for the attention core of the backward on Hopper (sm_90).

The same two passes and the same math as kernels/softmax_bwd.py (read its docstring for
the algorithm); what differs is how a program spends its time. Triton's `tl.dot` waits
for every wgmma before the next instruction (the Triton templates' SASS), so a program
loads, splits, multiplies and waits in series. Here every product is an asynchronous
wgmma (`warpgroup_mma(..., is_async=True)`) and the program waits only where it needs a
result, so the tensor cores work while the same warps load the next P tile, split tiles
into bf16 halves and form dS:

    cols pass, per query tile j (a program owns BLOCK_N keys):
        issue  dP^T_j = v @ dO_j^T                  [BN,BM]   (RECOMPUTE_P: first
        wait   for dV_{j-1}      (it reads the registers the split of P^T_j reuses)
        issue  dV    += P^T_j @ dO_j                [BN,D]     logits^T_j = k @ q_j^T,
        load   P^T_{j+1} (registers)                           waited for instead)
        wait   for dP^T_j        (dV_j still in flight)
        issue  dK    += (P^T_j * (dP^T_j - delta_j)) @ q_j
        copy   dO_{j+S-1}, q_{j+S-1} into the ring slot that tile j-1 used
    rows pass, per key tile j (a program owns BLOCK_M queries):
        issue  dP_j = dO @ v_j^T                    [BM,BN]   (RECOMPUTE_P: first
        wait   for pk_{j-1}      (P given only)                logits_j = q @ k_j^T,
        issue  pk  += P_j @ k_j   (P given only)    [BM,D]     waited for instead)
        load   P_{j+1}
        wait   for dP_j          (pk_j still in flight)
        issue  gsk += (P_j * dP_j) @ k_j, or (P_j * (dP_j - delta)) @ k_j with RECOMPUTE_P
        copy   k_{j+S-1}, v_{j+S-1} into the ring slot that tile j-1 used

Operands: the bf16 halves of dO, q, k and v (made once by the caller) are copied into
shared memory with cp.async (`async_copy`), NUM_STAGES tiles deep; a program's own rows
(v in the cols pass, dO in the rows pass, k / q as well with RECOMPUTE_P) are copied once.
P tiles (float32, rows of 577 floats: not 16-byte aligned, so no TMA) are loaded straight
into the registers of the accumulator layout, one tile ahead, unmasked from clamped
indices (`clamped`), and asked of the L2 PREFETCH tiles ahead of that (`prefetch_to_l2`);
S x S tiles never leave the registers: split into bf16 halves (hi
by truncation, an integer mask: a float -> bf16 conversion per element was the loop's
costliest instruction), they are the A operands of the next products. The caller's
operand halves are rounded, so each product has one rounded and one truncated operand
(the neglected lo * lo term stays at 2^-15; rounded S x S splits measured 25% less
error against float64 and a 15% slower cols pass on the H200).
Waits name the register operands of the products still in flight
(`deps`), so the compiler keeps them until those products have read them.

Measured on the H200, batch 32:
rows 0.55-0.60 and cols 0.66-0.68 ms (the Triton templates 0.622 and 0.734); ncu puts the bound in
load latency at 2-3 blocks of 4 warps per SM, not in the waits. The L2 prefetch took
the cols pass from 0.775 ms (32 x 64 tiles) and left the rows pass within its spread.

PRODUCTS is the number of products per matmul: 3 is bf16x3 (a_lo b_hi + a_hi b_lo +
a_hi b_hi, small terms first, float32 accumulation) on the bf16 halves of float32
tensors, with the outputs of kernels/softmax_bwd.py in the same formats; 1 is one
product of operands in their own dtype, bf16 or fp16 (the operand pointers' element
type; VisionAttentionBlock under autocast), where only the hi tiles are copied, the
S x S tiles are rounded to that dtype, and a gradient is stored once, in that dtype, in
GRAD16 (HALVES_WIDTH 0: no halves). Measured on the H200 at batch 32, bf16, P recomputed
(the one-product core): rows 0.225 ms, cols 0.366, against 0.716 for torch's
flash-attention backward and 0.446 for cuDNN's at the same errors against float64.
PRODUCTS 3 with fp16 operand pointers is fp16x3 on scaled fp16 halves (precision
"highest"): fp16 hi + lo holds 22 of float32's 24 bits where bf16's hold 16, so every
product is float32-grade, provided its operands lie in fp16's range. The caller scales
dO, q, k and v by powers of two (SCALES: s_do, s_q, s_k, s_v) so that each one's largest
magnitude lies in [2^14, 2^15), and gives s_ds, which brings dS below 2^14 (|dS| <= |dP| +
|delta| <= 2 max_i |dO_i| max_j |v_j| over rows, in the scaled units); the S x S tiles
are scaled before their split (rounded to nearest): P (at most 1) by P_SCALE, dS by
s_ds (a bound from the largest elements of dO and v, 2 * HEAD_DIM * 2^30, would leave a
typical dS tile 2^8 lower). What bounds these products on the H200 is then the tensor
cores' float32 accumulation, which truncates: ~2e-6 against float64 at S = 577, against
~1e-5 for bf16x3 (precision "highest"). Every
scale is a power of two, so scaling is exact; the kernels take the scales out of the
logits, delta and the outputs, and store each gradient once, in float32, in GRAD16 (no
halves: the graph makes the next GEMMs' operands, with scales of their own).
No atomics: every output element is written by one program (deterministic).

Head dims: any multiple of 8 up to 128. Every [.., HEAD_DIM] tile is HEAD_TILE =
padded_head_dim(HEAD_DIM) wide (the next power of two: Gluon shapes are powers of two,
and a wgmma's K a multiple of 16 and N of 8): the copies zero-fill the columns past
HEAD_DIM in shared memory (a multiple of 8 keeps every 16-byte cp.async whole), which
add nothing to any product, and the stores mask them off. The helpers take the real
HEAD_DIM and pad their tiles themselves.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                              warpgroup_mma,
                                                              warpgroup_mma_init,
                                                              warpgroup_mma_wait)
# Gluon's aggregate classes (its own kernels import the decorator from here too)
from triton.language.core import _aggregate as aggregate

from .gluon_compat import async_load, cta_barrier
from .softmax_bwd import padded_head_dim

LOG2E = gl.constexpr(1.4426950408889634)
# what the fp16-halves kernels multiply a P tile by before its split
P_SCALE = gl.constexpr(16384.0)


@gluon.constexpr_function
def fp16_halves(products, dtype):
    """Whether operands of `dtype` at `products` products are scaled fp16 halves."""
    return products == 3 and dtype == gl.float16


@gluon.constexpr_function
def halves_parts(products, dtype):
    """1 where the kernels store their gradients' bf16 halves too (bf16x3), else 0."""
    return 1 if products == 3 and dtype == gl.bfloat16 else 0


@gluon.constexpr_function
def wgmma_layout(num_warps, columns):
    """The layout of a wgmma accumulator with `columns` columns, num_warps warps
    stacked along the rows (one warpgroup per 64 rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, columns, 16])


@gluon.constexpr_function
def copy_layout_of(num_warps, head_dim):
    """The layout the cp.async copies of [rows, head_dim] bf16 tiles use: 8 elements
    (16 bytes) per thread, a warp across 256 elements."""
    return gl.BlockedLayout([1, 8], [256 // head_dim, head_dim // 8], [num_warps, 1],
                            [1, 0])


@aggregate
class PassConstants:
    """A pass's compile-time constants, derived in one place from its kernel's: a program
    owns OWN_BLOCK rows (queries in the rows pass, keys in the cols pass) and sweeps the
    other side in NUM_TILES tiles of SWEPT_BLOCK rows, NUM_STAGES deep in shared memory;
    its S x S tiles are [OWN_BLOCK, SWEPT_BLOCK] (P and dP, or P^T and dP^T)."""
    ROWS_PASS: gl.constexpr          # the rows pass (dO, q owned; k, v swept), or cols
    SEQ_LEN: gl.constexpr
    NUM_HEADS: gl.constexpr
    HEAD_DIM: gl.constexpr
    EMBED: gl.constexpr              # NUM_HEADS * HEAD_DIM: grad_attn's row stride
    HEAD_TILE: gl.constexpr          # the width of every [.., D] tile, zero-padded
    OWN_BLOCK: gl.constexpr
    SWEPT_BLOCK: gl.constexpr
    NUM_TILES: gl.constexpr
    NUM_STAGES: gl.constexpr
    QKV_BATCH_STRIDE: gl.constexpr   # q, k, v's element strides (program_coordinates)
    QKV_HEAD_STRIDE: gl.constexpr
    QKV_ROW_STRIDE: gl.constexpr
    dtype: gl.constexpr              # the operands' bf16 / fp16
    PARTS: gl.constexpr              # 2: hi and lo tiles; 1: hi alone (one product)
    SCALED: gl.constexpr             # scaled fp16 halves (fp16_halves)
    P_FACTOR: gl.constexpr           # what a P tile is multiplied by before its split
    HALVES: gl.constexpr             # halves_parts: whether the bf16 halves are stored
    tile_layout: gl.constexpr        # the S x S tiles
    acc_layout: gl.constexpr         # the [OWN_BLOCK, HEAD_TILE] accumulators
    a_layout: gl.constexpr           # A operands of their products, from registers
    copy_layout: gl.constexpr        # the cp.async copies (copy_layout_of)
    row_vector: gl.constexpr         # [OWN_BLOCK] along an S x S tile's rows
    column_vector: gl.constexpr      # [SWEPT_BLOCK] along its columns

    @gluon.constexpr_function
    def __init__(self, ROWS_PASS, SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                 QKV_BATCH_STRIDE, QKV_HEAD_STRIDE, QKV_ROW_STRIDE, PRODUCTS, dtype,
                 num_warps):
        own_block, swept_block = (BLOCK_M, BLOCK_N) if ROWS_PASS else (BLOCK_N, BLOCK_M)
        head_tile = padded_head_dim(HEAD_DIM)
        scaled = fp16_halves(PRODUCTS, dtype)
        tile_layout = wgmma_layout(num_warps, swept_block)
        acc_layout = wgmma_layout(num_warps, head_tile)
        self.ROWS_PASS = gl.constexpr(ROWS_PASS)
        self.SEQ_LEN = gl.constexpr(SEQ_LEN)
        self.NUM_HEADS = gl.constexpr(NUM_HEADS)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.EMBED = gl.constexpr(NUM_HEADS * HEAD_DIM)
        self.HEAD_TILE = gl.constexpr(head_tile)
        self.OWN_BLOCK = gl.constexpr(own_block)
        self.SWEPT_BLOCK = gl.constexpr(swept_block)
        self.NUM_TILES = gl.constexpr((SEQ_LEN + swept_block - 1) // swept_block)
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.QKV_BATCH_STRIDE = gl.constexpr(QKV_BATCH_STRIDE)
        self.QKV_HEAD_STRIDE = gl.constexpr(QKV_HEAD_STRIDE)
        self.QKV_ROW_STRIDE = gl.constexpr(QKV_ROW_STRIDE)
        self.dtype = gl.constexpr(dtype)
        self.PARTS = gl.constexpr(2 if PRODUCTS == 3 else 1)
        self.SCALED = gl.constexpr(scaled)
        self.P_FACTOR = gl.constexpr(P_SCALE.value if scaled else 1.0)
        self.HALVES = gl.constexpr(halves_parts(PRODUCTS, dtype))
        self.tile_layout = gl.constexpr(tile_layout)
        self.acc_layout = gl.constexpr(acc_layout)
        self.a_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                         k_width=2))
        self.copy_layout = gl.constexpr(copy_layout_of(num_warps, head_tile))
        self.row_vector = gl.constexpr(gl.SliceLayout(1, tile_layout))
        self.column_vector = gl.constexpr(gl.SliceLayout(0, tile_layout))


@gluon.jit
def program_coordinates(c):
    """This program's (batch, head, first of its OWN_BLOCK rows, batch * NUM_HEADS +
    head, offset of its head in q, k, v, offset of its head's columns in grad_attn
    [B,S,E]) (c: the pass's PassConstants): program ids (row block, batch * NUM_HEADS +
    head), offsets in int64. q, k, v [B,H,S,D] are at element strides (QKV_BATCH_STRIDE,
    QKV_HEAD_STRIDE, QKV_ROW_STRIDE, 1): contiguous, or views of the module's QKV
    projection [B,S,3E]."""
    batch = gl.program_id(1) // c.NUM_HEADS
    head = gl.program_id(1) % c.NUM_HEADS
    batch_head = (batch * c.NUM_HEADS + head).to(gl.int64)
    return (batch, head, gl.program_id(0) * c.OWN_BLOCK, batch_head,
            batch.to(gl.int64) * c.QKV_BATCH_STRIDE + head.to(gl.int64) * c.QKV_HEAD_STRIDE,
            batch.to(gl.int64) * c.SEQ_LEN * c.NUM_HEADS * c.HEAD_DIM + head * c.HEAD_DIM)


@gluon.jit
def split_operand(x, dtype: gl.constexpr, PRODUCTS: gl.constexpr, layout: gl.constexpr,
                  factor):
    """float32 tile -> (hi, lo) tiles of the operand dtype in `layout`. For 3 products
    of bf16: hi = x truncated to bf16 (an integer mask, exact in bf16), lo = the rest
    rounded; of fp16 (scaled halves): x * factor rounded to fp16, lo = the rest rounded.
    For 1 product: hi = x rounded to `dtype` (bf16 or fp16), and lo is hi (no product
    reads it)."""
    if fp16_halves(PRODUCTS, dtype):
        x = x * factor
        hi16 = x.to(dtype)
        hi = gl.convert_layout(hi16, layout)
        lo = gl.convert_layout((x - hi16.to(gl.float32)).to(dtype), layout)
    elif PRODUCTS == 3:
        hi32 = (x.to(gl.int32, bitcast=True) & -65536).to(gl.float32, bitcast=True)
        hi = gl.convert_layout(hi32.to(dtype), layout)
        lo = gl.convert_layout((x - hi32).to(dtype), layout)
    else:
        hi = gl.convert_layout(x.to(dtype), layout)
        lo = hi
    return hi, lo


@gluon.jit
def issue_products(a_hi, a_lo, b_hi, b_lo, acc, use_acc: gl.constexpr,
                   PRODUCTS: gl.constexpr):
    """Issue acc + a @ b as PRODUCTS asynchronous wgmmas (one wgmma group each); the
    result may be read only after a wait that covers them."""
    if PRODUCTS == 3:
        acc = warpgroup_mma(a_lo, b_hi, acc, use_acc=use_acc, is_async=True)
        acc = warpgroup_mma(a_hi, b_lo, acc, is_async=True)
        acc = warpgroup_mma(a_hi, b_hi, acc, is_async=True)
    else:
        acc = warpgroup_mma(a_hi, b_hi, acc, use_acc=use_acc, is_async=True)
    return acc


@gluon.jit
def copy_rows(smem, base, row_start, row_stride, SEQ_LEN: gl.constexpr,
              BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """cp.async of rows [row_start, row_start + BLOCK) x HEAD_DIM of a bf16 matrix at
    `base` into `smem` [BLOCK, HEAD_TILE]; rows past SEQ_LEN and columns past HEAD_DIM
    are zero-filled."""
    rows = row_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, padded_head_dim(HEAD_DIM), layout=gl.SliceLayout(0, layout))
    pointers = base + rows[:, None].to(gl.int64) * row_stride + cols[None, :]
    mask = (rows < SEQ_LEN)[:, None]
    if padded_head_dim(HEAD_DIM) != HEAD_DIM:
        mask = mask & (cols < HEAD_DIM)[None, :]
    async_load(smem, pointers, mask=mask)


@gluon.jit
def copy_pair(c, smem, index, HI, LO, row_start, row_stride, BLOCK: gl.constexpr):
    """The c.PARTS parts of one operand tile of BLOCK rows (hi and lo; hi alone for one
    product) into smem.index(c.PARTS * index) onwards (c: the pass's PassConstants)."""
    copy_rows(smem.index(c.PARTS * index), HI, row_start, row_stride, c.SEQ_LEN, BLOCK,
              c.HEAD_DIM, c.copy_layout)
    if c.PARTS == 2:
        copy_rows(smem.index(2 * index + 1), LO, row_start, row_stride, c.SEQ_LEN, BLOCK,
                  c.HEAD_DIM, c.copy_layout)


@gluon.jit
def tile_parts(smem, index, PARTS: gl.constexpr):
    """The (hi, lo) shared-memory tiles copy_pair filled at `index` (lo is hi for one
    part)."""
    return smem.index(PARTS * index), smem.index(PARTS * index + PARTS - 1)


@gluon.jit
def clamped(index, SEQ_LEN: gl.constexpr):
    """Row or column indices of P clamped into the matrix. The P tiles are loaded without
    masks from clamped indices: what a clamped row or column holds never reaches an
    output (rows past SEQ_LEN are not stored; keys and queries past SEQ_LEN meet
    zero-filled k, v, dO and q tiles and a zero delta in every product). P's rows (577
    floats) are only 4-byte aligned, so no TMA: the kernels load each P tile one tile
    ahead, into the registers of the accumulator layout."""
    return gl.minimum(index, SEQ_LEN - 1)


@gluon.jit
def prefetch_to_l2(base, row_start, col_start, SEQ_LEN: gl.constexpr, ROWS: gl.constexpr,
                   COLS: gl.constexpr, num_warps: gl.constexpr):
    """Ask the L2 for the cache lines of the P tile rows [row_start, +ROWS) x columns
    [col_start, +COLS) (indices clamped, as `clamped`), taking no registers and never
    waited for: `prefetch.global.L2` at COLS // 16 points per row, under 128 bytes
    apart, so every line a row's segment touches is named. The register load of that
    tile, PREFETCH tiles later, then finds it in the L2 instead of HBM."""
    POINTS: gl.constexpr = COLS // 16
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // POINTS, POINTS], [num_warps, 1],
                                            [1, 0])
    rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = col_start + (gl.arange(0, POINTS, layout=gl.SliceLayout(0, layout))
                        * ((COLS - 1) // (POINTS - 1)))
    pointers = (base + (clamped(rows, SEQ_LEN) * SEQ_LEN)[:, None]
                + clamped(cols, SEQ_LEN)[None, :])
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [pointers],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def load_vector(base, start, SEQ_LEN: gl.constexpr, BLOCK: gl.constexpr,
                layout: gl.constexpr):
    offsets = start + gl.arange(0, BLOCK, layout=layout)
    return gl.load(base + offsets, mask=offsets < SEQ_LEN, other=0.0)


@gluon.jit
def operand_scales(SCALES, SCALED: gl.constexpr):
    """(s_do, s_q, s_k, s_v, s_ds): the powers of two the caller scaled dO, q, k and v
    by, and the one for dS (fp16 halves), else ones."""
    if SCALED:
        return (gl.load(SCALES), gl.load(SCALES + 1), gl.load(SCALES + 2),
                gl.load(SCALES + 3), gl.load(SCALES + 4))
    return 1.0, 1.0, 1.0, 1.0, 1.0


@gluon.jit
def store_gradient(GRAD16, HALVES, value, batch, row_start, col, SEQ_LEN: gl.constexpr,
                   ROW_WIDTH16: gl.constexpr, HALVES_WIDTH: gl.constexpr,
                   LO_OFFSET: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                   layout: gl.constexpr):
    """A float32 [BLOCK, HEAD_TILE] gradient tile of rows [row_start, +BLOCK) of one
    batch element (its first HEAD_DIM columns): rounded to GRAD16's dtype (fp16 with
    float32 operands, else the operands' dtype; float32 with fp16 halves) at column
    `col` of GRAD16 [B,S,ROW_WIDTH16], and, where HALVES_WIDTH > 0 (bf16 halves), as
    bf16 hi at column `col` and lo at `col + LO_OFFSET` of HALVES [B,S,HALVES_WIDTH]."""
    rows = row_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    head_cols = gl.arange(0, padded_head_dim(HEAD_DIM), layout=gl.SliceLayout(0, layout))
    cols = col + head_cols
    token = (batch * SEQ_LEN + rows[:, None]).to(gl.int64)
    mask = (rows < SEQ_LEN)[:, None]
    if padded_head_dim(HEAD_DIM) != HEAD_DIM:
        mask = mask & (head_cols < HEAD_DIM)[None, :]
    gl.store(GRAD16 + token * ROW_WIDTH16 + cols[None, :],
             value.to(GRAD16.dtype.element_ty), mask=mask)
    if HALVES_WIDTH > 0:
        hi = value.to(gl.bfloat16)
        lo = (value - hi.to(gl.float32)).to(gl.bfloat16)
        gl.store(HALVES + token * HALVES_WIDTH + cols[None, :], hi, mask=mask)
        gl.store(HALVES + token * HALVES_WIDTH + LO_OFFSET + cols[None, :], lo, mask=mask)


@gluon.jit
def store_column_sums(SUMS, value, batch, row_start, col, SEQ_LEN: gl.constexpr,
                      SUMS_WIDTH: gl.constexpr, SUM_ROWS: gl.constexpr, BLOCK: gl.constexpr,
                      HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """The sum over rows of a float32 [BLOCK, HEAD_TILE] gradient tile of rows [row_start,
    +BLOCK) of one batch element (rows past SEQ_LEN left out), its first HEAD_DIM
    columns at column `col` of SUMS
    [B, cdiv(SEQ_LEN, SUM_ROWS), SUMS_WIDTH]: kernels/softmax_bwd.py's
    store_column_sums (the group where the tile starts gets the sum, the other groups it
    covers zeros)."""
    gl.static_assert(BLOCK % SUM_ROWS == 0)
    GROUPS: gl.constexpr = (SEQ_LEN + SUM_ROWS - 1) // SUM_ROWS
    rows = row_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    head_cols = gl.arange(0, padded_head_dim(HEAD_DIM), layout=gl.SliceLayout(0, layout))
    cols = col + head_cols
    sums = gl.sum(gl.where((rows < SEQ_LEN)[:, None], value, 0.0), axis=0)  # [HEAD_TILE]
    col_ok = None
    if padded_head_dim(HEAD_DIM) != HEAD_DIM:
        col_ok = head_cols < HEAD_DIM
    for part in gl.static_range(BLOCK // SUM_ROWS):
        group = row_start // SUM_ROWS + part
        if group < GROUPS:
            gl.store(SUMS + (batch * GROUPS + group) * SUMS_WIDTH + cols,
                     sums if part == 0 else gl.zeros_like(sums), mask=col_ok)


@gluon.jit
def next_p_tile(probs_rows, row_offsets, keys, m_start, n_start, SEQ_LEN: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PREFETCH: gl.constexpr,
                num_warps: gl.constexpr):
    """A rows pass's P tile [BM,BN] of the key tile after the current one (its `keys`,
    in the tile layout's key vector, from n_start), loaded into registers from clamped
    indices (row_offsets: the program's queries, clamped, times SEQ_LEN, as a column);
    and the L2 asked for the tile PREFETCH tiles after that one (prefetch_to_l2). The
    cols passes' twin is next_p_t_tile."""
    p = gl.load(probs_rows + row_offsets + clamped(keys + BLOCK_N, SEQ_LEN)[None, :])
    if PREFETCH > 0:
        prefetch_to_l2(probs_rows, m_start, n_start + (PREFETCH + 1) * BLOCK_N, SEQ_LEN,
                       BLOCK_M, BLOCK_N, num_warps)
    return p


@gluon.jit
def next_p_t_tile(probs_head, key_offsets, queries, m_start, n_start, SEQ_LEN: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PREFETCH: gl.constexpr,
                  num_warps: gl.constexpr):
    """A cols pass's P^T tile [BN,BM] of the query tile after the current one (its
    `queries`, in the tile layout's query vector, from m_start), loaded into registers
    from clamped indices (key_offsets: the program's keys, clamped, as a column); and
    the L2 asked for the tile PREFETCH tiles after that one (prefetch_to_l2)."""
    p_t = gl.load(probs_head + key_offsets
                  + (clamped(queries + BLOCK_M, SEQ_LEN) * SEQ_LEN)[None, :])
    if PREFETCH > 0:
        prefetch_to_l2(probs_head, m_start + (PREFETCH + 1) * BLOCK_M, n_start, SEQ_LEN,
                       BLOCK_M, BLOCK_N, num_warps)
    return p_t


@gluon.jit
def start_pass(c, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO, V_HI, V_LO, SCALES,
               scale, RECOMPUTE_P: gl.constexpr, OPERAND_SMEM: gl.constexpr):
    """The opening both passes share (c: their PassConstants). Returns this program's
    place (program_coordinates); its units: grad_p_units (dP and delta in the units of
    the scaled dO and v), logit_scale (the logits' scale in the units of q and k, times
    log2(e)), then s_do, s_q, s_k, s_v, s_ds (operand_scales); and its operand tiles in
    shared memory, their first copies issued: the rows it owns, once, in `own` (rows
    pass: dO, and q with RECOMPUTE_P; cols pass: v, and k), and two rings of the tiles
    it sweeps (rows pass: k, v; cols pass: dO, q), their first NUM_STAGES - 1 tiles
    (copy_swept_tiles)."""
    batch, head, start, batch_head, head_start, grad_attn_start = program_coordinates(c)
    do_s, q_s, k_s, v_s, ds_s = operand_scales(SCALES, c.SCALED)
    grad_p_units = do_s * v_s
    logit_scale = scale * LOG2E / (q_s * k_s)

    own = gl.allocate_shared_memory(c.dtype, [c.PARTS * (1 + RECOMPUTE_P), c.OWN_BLOCK,
                                              c.HEAD_TILE], OPERAND_SMEM)
    ring_first = gl.allocate_shared_memory(c.dtype, [c.PARTS * c.NUM_STAGES, c.SWEPT_BLOCK,
                                                     c.HEAD_TILE], OPERAND_SMEM)
    ring_second = gl.allocate_shared_memory(c.dtype, [c.PARTS * c.NUM_STAGES,
                                                      c.SWEPT_BLOCK, c.HEAD_TILE],
                                            OPERAND_SMEM)
    if c.ROWS_PASS:
        copy_pair(c, own, 0, GRAD_ATTN_HI + grad_attn_start, GRAD_ATTN_LO + grad_attn_start,
                  start, c.EMBED, c.OWN_BLOCK)
        if RECOMPUTE_P:
            copy_pair(c, own, 1, Q_HI + head_start, Q_LO + head_start, start,
                      c.QKV_ROW_STRIDE, c.OWN_BLOCK)
    else:
        copy_pair(c, own, 0, V_HI + head_start, V_LO + head_start, start, c.QKV_ROW_STRIDE,
                  c.OWN_BLOCK)
        if RECOMPUTE_P:
            copy_pair(c, own, 1, K_HI + head_start, K_LO + head_start, start,
                      c.QKV_ROW_STRIDE, c.OWN_BLOCK)
    for stage in gl.static_range(c.NUM_STAGES - 1):
        copy_swept_tiles(c, ring_first, ring_second, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO,
                         K_HI, K_LO, V_HI, V_LO, head_start, grad_attn_start, stage)
    return (batch, head, start, batch_head, head_start, grad_attn_start,
            (grad_p_units, logit_scale, do_s, q_s, k_s, v_s, ds_s), own, ring_first,
            ring_second)


@gluon.jit
def copy_swept_tiles(c, ring_first, ring_second, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO,
                     K_HI, K_LO, V_HI, V_LO, head_start, grad_attn_start, tile):
    """Issue, as one cp.async group, the copies of tile `tile` (rows [tile * SWEPT_BLOCK,
    +SWEPT_BLOCK)) of the two operands a pass sweeps into slot tile % NUM_STAGES of their
    rings: k and v in the rows pass, dO and q in the cols pass."""
    slot = tile % c.NUM_STAGES
    row_start = tile * c.SWEPT_BLOCK
    if c.ROWS_PASS:
        copy_pair(c, ring_first, slot, K_HI + head_start, K_LO + head_start, row_start,
                  c.QKV_ROW_STRIDE, c.SWEPT_BLOCK)
        copy_pair(c, ring_second, slot, V_HI + head_start, V_LO + head_start, row_start,
                  c.QKV_ROW_STRIDE, c.SWEPT_BLOCK)
    else:
        copy_pair(c, ring_first, slot, GRAD_ATTN_HI + grad_attn_start,
                  GRAD_ATTN_LO + grad_attn_start, row_start, c.EMBED, c.SWEPT_BLOCK)
        copy_pair(c, ring_second, slot, Q_HI + head_start, Q_LO + head_start, row_start,
                  c.QKV_ROW_STRIDE, c.SWEPT_BLOCK)
    async_copy.commit_group()


@gluon.jit
def cols_carried_values(BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                        HEAD_TILE: gl.constexpr, dtype: gl.constexpr,
                        acc_layout: gl.constexpr, a_layout: gl.constexpr):
    """What a cols pass carries from one query tile to the next, as it starts: the dK
    and dV accumulators [BN,D] (zero; they stay in flight from tile to tile) and the
    register operands of the products still in flight from the previous tile (P^T hi,
    lo, dS^T hi, lo [BN,BM]; zero before the first)."""
    grad_k = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_TILE], gl.float32, layout=acc_layout))
    grad_v = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_TILE], gl.float32, layout=acc_layout))
    operand = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=a_layout)
    return grad_k, grad_v, operand, operand, operand, operand


@gluon.jit
def store_cols_outputs(GRAD_KV16, GRAD_KV_HALVES, GRAD_KV_SUMS, grad_k, grad_v, batch, head,
                       n_start, SEQ_LEN: gl.constexpr, NUM_HEADS: gl.constexpr,
                       HEAD_DIM: gl.constexpr, HALVES: gl.constexpr, SUM_ROWS: gl.constexpr,
                       BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """A cols pass's dK and dV [BN, HEAD_TILE] of keys [n_start, +BN) of one (batch,
    head), finished (scaled), into its outputs: GRAD_KV16 [B,S,2E] (dK | dV), their bf16
    halves in GRAD_KV_HALVES [B,S,4E] where HALVES, and their sums over rows in
    GRAD_KV_SUMS [B,G,2E] (store_gradient, store_column_sums)."""
    EMBED: gl.constexpr = NUM_HEADS * HEAD_DIM
    store_gradient(GRAD_KV16, GRAD_KV_HALVES, grad_k, batch, n_start, head * HEAD_DIM,
                   SEQ_LEN, 2 * EMBED, 4 * EMBED * HALVES, 2 * EMBED, BLOCK_N, HEAD_DIM,
                   layout)
    store_gradient(GRAD_KV16, GRAD_KV_HALVES, grad_v, batch, n_start,
                   EMBED + head * HEAD_DIM, SEQ_LEN, 2 * EMBED, 4 * EMBED * HALVES,
                   2 * EMBED, BLOCK_N, HEAD_DIM, layout)
    store_column_sums(GRAD_KV_SUMS, grad_k, batch, n_start, head * HEAD_DIM, SEQ_LEN,
                      2 * EMBED, SUM_ROWS, BLOCK_N, HEAD_DIM, layout)
    store_column_sums(GRAD_KV_SUMS, grad_v, batch, n_start, EMBED + head * HEAD_DIM,
                      SEQ_LEN, 2 * EMBED, SUM_ROWS, BLOCK_N, HEAD_DIM, layout)


@gluon.jit
def softmax_bwd_cols_kernel(PROBS, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO,
                            V_HI, V_LO, SCALES, LSE, DELTA, GRAD_KV16, GRAD_KV_HALVES,
                            GRAD_KV_SUMS,
                            scale, SEQ_LEN: gl.constexpr, NUM_HEADS: gl.constexpr,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                            RECOMPUTE_P: gl.constexpr, PRODUCTS: gl.constexpr,
                            PREFETCH: gl.constexpr, SUM_ROWS: gl.constexpr,
                            OPERAND_SMEM: gl.constexpr, QKV_BATCH_STRIDE: gl.constexpr,
                            QKV_HEAD_STRIDE: gl.constexpr, QKV_ROW_STRIDE: gl.constexpr,
                            num_warps: gl.constexpr):
    """dK, dV of keys [n_start, n_start + BLOCK_N) of one (batch, head): program ids
    (key block, batch * NUM_HEADS + head). Outputs as kernels/softmax_bwd.py's cols
    kernel: GRAD_KV16 [B,S,2E] fp16 (dK | dV), GRAD_KV_HALVES [B,S,4E] bf16, GRAD_KV_SUMS
    [B,G,2E] float32. P is read from PROBS, or with RECOMPUTE_P recomputed from LSE
    [B,H,S] (the other is not read). SCALES: float32 [5], read with fp16 halves only."""
    c = PassConstants(False, SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                      QKV_BATCH_STRIDE, QKV_HEAD_STRIDE, QKV_ROW_STRIDE, PRODUCTS,
                      GRAD_ATTN_HI.dtype.element_ty, num_warps)
    # this program's keys: v (and k) once; the query-side tiles dO_j, q_j in rings
    (batch, head, n_start, batch_head, head_start, grad_attn_start, units, own,
     ring_grad_attn, ring_q) = start_pass(c, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI,
                                          K_LO, V_HI, V_LO, SCALES, scale, RECOMPUTE_P,
                                          OPERAND_SMEM)
    grad_p_units, logit_scale, do_s, q_s, k_s, v_s, ds_s = units

    keys = n_start + gl.arange(0, BLOCK_N, layout=c.row_vector)
    probs_head = PROBS + batch_head * SEQ_LEN * SEQ_LEN        # P [S,S] of this head
    lse_head = LSE + batch_head * SEQ_LEN                      # lse [S] of this head
    delta_head = DELTA + batch_head * SEQ_LEN
    if not RECOMPUTE_P:
        # P^T tiles [BN,BM]: element (key, query) at query * SEQ_LEN + key
        key_offsets = clamped(keys, SEQ_LEN)[:, None]
        queries = gl.arange(0, BLOCK_M, layout=c.column_vector)
        p_t_next = gl.load(probs_head + key_offsets
                           + (clamped(queries, SEQ_LEN) * SEQ_LEN)[None, :])
        for ahead in gl.static_range(1, PREFETCH + 1):
            prefetch_to_l2(probs_head, ahead * BLOCK_M, n_start, SEQ_LEN, BLOCK_M,
                           BLOCK_N, num_warps)
    zeros_tile = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=c.tile_layout)
    grad_k, grad_v, p_t_hi, p_t_lo, grad_s_t_hi, grad_s_t_lo = cols_carried_values(
        BLOCK_N, BLOCK_M, c.HEAD_TILE, c.dtype, c.acc_layout, c.a_layout)
    for m_tile in range(c.NUM_TILES):
        slot = m_tile % NUM_STAGES
        m_start = m_tile * BLOCK_M
        async_copy.wait_group(NUM_STAGES - 2)          # this tile's copies have landed
        cta_barrier()
        fence_async_shared()
        grad_attn_hi, grad_attn_lo = tile_parts(ring_grad_attn, slot, c.PARTS)  # [BM,D]
        q_hi, q_lo = tile_parts(ring_q, slot, c.PARTS)                        # [BM,D]
        queries = m_start + gl.arange(0, BLOCK_M, layout=c.column_vector)
        delta = (load_vector(delta_head, m_start, SEQ_LEN, BLOCK_M, c.column_vector)
                 * grad_p_units)
        if RECOMPUTE_P:
            lse = load_vector(lse_head, m_start, SEQ_LEN, BLOCK_M, c.column_vector)
            k_hi, k_lo = tile_parts(own, 1, c.PARTS)                      # [BN,D]
            logits_t = issue_products(k_hi, k_lo, q_hi.permute((1, 0)),
                                      q_lo.permute((1, 0)), zeros_tile, False, PRODUCTS)
        v_hi, v_lo = tile_parts(own, 0, c.PARTS)                          # [BN,D]
        grad_p_t = issue_products(v_hi, v_lo, grad_attn_hi.permute((1, 0)),
                                  grad_attn_lo.permute((1, 0)), zeros_tile, False,
                                  PRODUCTS)                                # [BN,BM]
        if RECOMPUTE_P:
            # the previous tile's products are done once these logits are
            logits_t, p_t_hi, p_t_lo, grad_s_t_hi, grad_s_t_lo = warpgroup_mma_wait(
                PRODUCTS, deps=(logits_t, p_t_hi, p_t_lo, grad_s_t_hi, grad_s_t_lo))
            valid = (keys < SEQ_LEN)[:, None] & (queries < SEQ_LEN)[None, :]
            p_t = gl.where(valid, gl.exp2(logits_t * logit_scale
                                          - (lse * LOG2E)[None, :]), 0.0)
        else:
            # dV of the previous tile is done reading the registers about to be reused
            p_t_hi, p_t_lo = warpgroup_mma_wait(2 * PRODUCTS, deps=(p_t_hi, p_t_lo))
            p_t = p_t_next
        p_t_hi, p_t_lo = split_operand(p_t, c.dtype, PRODUCTS, c.a_layout, c.P_FACTOR)
        grad_v = issue_products(p_t_hi, p_t_lo, grad_attn_hi, grad_attn_lo, grad_v, True,
                                PRODUCTS)
        if RECOMPUTE_P:
            grad_p_t = warpgroup_mma_wait(PRODUCTS, deps=(grad_p_t,))
        else:
            p_t_next = next_p_t_tile(probs_head, key_offsets, queries, m_start, n_start,
                                     SEQ_LEN, BLOCK_M, BLOCK_N, PREFETCH, num_warps)
            grad_p_t, grad_s_t_hi, grad_s_t_lo = warpgroup_mma_wait(
                PRODUCTS, deps=(grad_p_t, grad_s_t_hi, grad_s_t_lo))
        grad_s_t = p_t * (grad_p_t - delta[None, :])                      # [BN,BM]
        grad_s_t_hi, grad_s_t_lo = split_operand(grad_s_t, c.dtype, PRODUCTS, c.a_layout,
                                                 ds_s)
        grad_k = issue_products(grad_s_t_hi, grad_s_t_lo, q_hi, q_lo, grad_k, True,
                                PRODUCTS)
        # every warpgroup is past the products of tile m_tile - 1: refill its slot
        cta_barrier()
        copy_swept_tiles(c, ring_grad_attn, ring_q, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO,
                         K_HI, K_LO, V_HI, V_LO, head_start, grad_attn_start,
                         m_tile + NUM_STAGES - 1)
    grad_k, grad_v, p_t_hi, p_t_lo, grad_s_t_hi, grad_s_t_lo = warpgroup_mma_wait(
        0, deps=(grad_k, grad_v, p_t_hi, p_t_lo, grad_s_t_hi, grad_s_t_lo))
    async_copy.wait_group(0)

    grad_k = grad_k * (scale / (ds_s * grad_p_units * q_s))
    if c.SCALED:
        grad_v = grad_v * (1.0 / (c.P_FACTOR * do_s))
    store_cols_outputs(GRAD_KV16, GRAD_KV_HALVES, GRAD_KV_SUMS, grad_k, grad_v, batch, head,
                       n_start, SEQ_LEN, NUM_HEADS, HEAD_DIM, c.HALVES, SUM_ROWS, BLOCK_N,
                       c.acc_layout)


@gluon.jit
def store_rows_outputs(DELTA, GRAD_Q16, GRAD_Q_HALVES, GRAD_Q_SUMS, grad_q, delta, batch_head,
                       batch, head, m_start, SEQ_LEN: gl.constexpr, NUM_HEADS: gl.constexpr,
                       HEAD_DIM: gl.constexpr, HALVES: gl.constexpr, SUM_ROWS: gl.constexpr,
                       BLOCK_M: gl.constexpr, vector_layout: gl.constexpr,
                       layout: gl.constexpr):
    """A rows pass's delta [BM] (in vector_layout) and finished dQ [BM, HEAD_TILE] of
    queries [m_start, +BM) of one (batch, head) into its outputs: DELTA [B,H,S], GRAD_Q16
    [B,S,E], dQ's bf16 halves in GRAD_Q_HALVES [B,S,2E] where HALVES, and its sums over
    rows in GRAD_Q_SUMS [B,G,E] (store_gradient, store_column_sums)."""
    EMBED: gl.constexpr = NUM_HEADS * HEAD_DIM
    delta_rows = m_start + gl.arange(0, BLOCK_M, layout=vector_layout)
    gl.store(DELTA + batch_head * SEQ_LEN + delta_rows, delta, mask=delta_rows < SEQ_LEN)
    store_gradient(GRAD_Q16, GRAD_Q_HALVES, grad_q, batch, m_start, head * HEAD_DIM,
                   SEQ_LEN, EMBED, 2 * EMBED * HALVES, EMBED, BLOCK_M, HEAD_DIM, layout)
    store_column_sums(GRAD_Q_SUMS, grad_q, batch, m_start, head * HEAD_DIM, SEQ_LEN, EMBED,
                      SUM_ROWS, BLOCK_M, HEAD_DIM, layout)


@gluon.jit
def softmax_bwd_rows_kernel(PROBS, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO,
                            V_HI, V_LO, SCALES, LSE, ATTN_OUT, GRAD_Q16, GRAD_Q_HALVES, DELTA,
                            GRAD_Q_SUMS, scale, SEQ_LEN: gl.constexpr,
                            NUM_HEADS: gl.constexpr,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                            RECOMPUTE_P: gl.constexpr, PRODUCTS: gl.constexpr,
                            PREFETCH: gl.constexpr, SUM_ROWS: gl.constexpr,
                            OPERAND_SMEM: gl.constexpr, QKV_BATCH_STRIDE: gl.constexpr,
                            QKV_HEAD_STRIDE: gl.constexpr, QKV_ROW_STRIDE: gl.constexpr,
                            num_warps: gl.constexpr):
    """dQ and delta of queries [m_start, m_start + BLOCK_M) of one (batch, head):
    program ids (query block, batch * NUM_HEADS + head). Outputs as
    kernels/softmax_bwd.py's rows kernel: GRAD_Q16 [B,S,E] fp16, GRAD_Q_HALVES [B,S,2E]
    bf16, DELTA [B,H,S], GRAD_Q_SUMS [B,G,E] float32. P is read from PROBS, or with
    RECOMPUTE_P recomputed from LSE [B,H,S], delta = rowsum(dO * O) then coming from
    ATTN_OUT [B,S,E]; the other
    of PROBS and LSE, and ATTN_OUT with P given, are not read. SCALES: float32 [5], read
    with fp16 halves only; DELTA is stored unscaled."""
    c = PassConstants(True, SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                      QKV_BATCH_STRIDE, QKV_HEAD_STRIDE, QKV_ROW_STRIDE, PRODUCTS,
                      GRAD_ATTN_HI.dtype.element_ty, num_warps)
    # this program's queries: dO (and q) once; the key-side tiles k_j, v_j in rings
    (batch, head, m_start, batch_head, head_start, grad_attn_start, units, own, ring_k,
     ring_v) = start_pass(c, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO, V_HI,
                          V_LO, SCALES, scale, RECOMPUTE_P, OPERAND_SMEM)
    grad_p_units, logit_scale, do_s, q_s, k_s, v_s, ds_s = units

    queries = m_start + gl.arange(0, BLOCK_M, layout=c.row_vector)
    probs_rows = PROBS + batch_head * SEQ_LEN * SEQ_LEN
    keys = gl.arange(0, BLOCK_N, layout=c.column_vector)
    if RECOMPUTE_P:
        lse = load_vector(LSE + batch_head * SEQ_LEN, m_start, SEQ_LEN, BLOCK_M,
                          c.row_vector)
        # delta = rowsum(dO * O), both [BM,D] rows of this head in [B,S,E]
        head_cols = gl.arange(0, c.HEAD_TILE, layout=gl.SliceLayout(0, c.tile_layout))
        rows_e = (batch * SEQ_LEN + queries[:, None]).to(gl.int64) * c.EMBED
        offsets = rows_e + head * HEAD_DIM + head_cols[None, :]
        row_ok = (queries < SEQ_LEN)[:, None]
        if c.HEAD_TILE != HEAD_DIM:
            row_ok = row_ok & (head_cols < HEAD_DIM)[None, :]
        grad_attn = gl.load(GRAD_ATTN_HI + offsets, mask=row_ok, other=0.0).to(gl.float32)
        if c.PARTS == 2:
            grad_attn += gl.load(GRAD_ATTN_LO + offsets, mask=row_ok, other=0.0).to(gl.float32)
        attn_output = gl.load(ATTN_OUT + offsets, mask=row_ok, other=0.0).to(gl.float32)
        delta = gl.sum(grad_attn * attn_output, axis=1) * v_s             # [BM]
    else:
        delta = gl.zeros([BLOCK_M], gl.float32, layout=c.row_vector)      # summed below
        row_offsets = (clamped(queries, SEQ_LEN) * SEQ_LEN)[:, None]
        p_next = gl.load(probs_rows + row_offsets + clamped(keys, SEQ_LEN)[None, :])
        for ahead in gl.static_range(1, PREFETCH + 1):
            prefetch_to_l2(probs_rows, m_start, ahead * BLOCK_N, SEQ_LEN, BLOCK_M, BLOCK_N,
                           num_warps)
        p_k = warpgroup_mma_init(gl.zeros([BLOCK_M, c.HEAD_TILE], gl.float32,
                                          layout=c.acc_layout))
    zeros_tile = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=c.tile_layout)
    grad_s_k = warpgroup_mma_init(gl.zeros([BLOCK_M, c.HEAD_TILE], gl.float32,
                                           layout=c.acc_layout))
    p_hi = gl.zeros([BLOCK_M, BLOCK_N], c.dtype, layout=c.a_layout)
    p_lo = p_hi
    grad_s_hi = p_hi
    grad_s_lo = p_hi
    for n_tile in range(c.NUM_TILES):
        slot = n_tile % NUM_STAGES
        n_start = n_tile * BLOCK_N
        async_copy.wait_group(NUM_STAGES - 2)
        cta_barrier()
        fence_async_shared()
        k_hi, k_lo = tile_parts(ring_k, slot, c.PARTS)                     # [BN,D]
        v_hi, v_lo = tile_parts(ring_v, slot, c.PARTS)
        keys = n_start + gl.arange(0, BLOCK_N, layout=c.column_vector)
        if RECOMPUTE_P:
            q_hi, q_lo = tile_parts(own, 1, c.PARTS)                      # [BM,D]
            logits = issue_products(q_hi, q_lo, k_hi.permute((1, 0)),
                                    k_lo.permute((1, 0)), zeros_tile, False, PRODUCTS)
        grad_attn_hi, grad_attn_lo = tile_parts(own, 0, c.PARTS)          # [BM,D]
        grad_p = issue_products(grad_attn_hi, grad_attn_lo, v_hi.permute((1, 0)),
                                v_lo.permute((1, 0)), zeros_tile, False, PRODUCTS)  # [BM,BN]
        if RECOMPUTE_P:
            logits, grad_s_hi, grad_s_lo = warpgroup_mma_wait(
                PRODUCTS, deps=(logits, grad_s_hi, grad_s_lo))
            valid = (queries < SEQ_LEN)[:, None] & (keys < SEQ_LEN)[None, :]
            p = gl.where(valid, gl.exp2(logits * logit_scale
                                        - (lse * LOG2E)[:, None]), 0.0)
            grad_p = warpgroup_mma_wait(0, deps=(grad_p,))
            grad_s = p * (grad_p - delta[:, None])
        else:
            p_hi, p_lo = warpgroup_mma_wait(2 * PRODUCTS, deps=(p_hi, p_lo))
            p = p_next
            p_hi, p_lo = split_operand(p, c.dtype, PRODUCTS, c.a_layout, c.P_FACTOR)
            p_k = issue_products(p_hi, p_lo, k_hi, k_lo, p_k, True, PRODUCTS)
            p_next = next_p_tile(probs_rows, row_offsets, keys, m_start, n_start, SEQ_LEN,
                                 BLOCK_M, BLOCK_N, PREFETCH, num_warps)
            grad_p, grad_s_hi, grad_s_lo = warpgroup_mma_wait(
                PRODUCTS, deps=(grad_p, grad_s_hi, grad_s_lo))
            grad_s = p * grad_p
            delta += gl.sum(grad_s, axis=1)
        grad_s_hi, grad_s_lo = split_operand(grad_s, c.dtype, PRODUCTS, c.a_layout, ds_s)
        grad_s_k = issue_products(grad_s_hi, grad_s_lo, k_hi, k_lo, grad_s_k, True,
                                  PRODUCTS)
        cta_barrier()
        copy_swept_tiles(c, ring_k, ring_v, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO,
                         V_HI, V_LO, head_start, grad_attn_start, n_tile + NUM_STAGES - 1)
    async_copy.wait_group(0)
    if RECOMPUTE_P:
        grad_s_k, grad_s_hi, grad_s_lo = warpgroup_mma_wait(
            0, deps=(grad_s_k, grad_s_hi, grad_s_lo))
        grad_q = grad_s_k * (scale / (ds_s * grad_p_units * k_s))
    else:
        grad_s_k, p_k, p_hi, p_lo, grad_s_hi, grad_s_lo = warpgroup_mma_wait(
            0, deps=(grad_s_k, p_k, p_hi, p_lo, grad_s_hi, grad_s_lo))
        delta_acc = gl.convert_layout(delta, gl.SliceLayout(1, c.acc_layout))
        grad_q = ((grad_s_k - delta_acc[:, None] * p_k * (ds_s / c.P_FACTOR))
                  * (scale / (ds_s * grad_p_units * k_s)))

    if c.SCALED:
        delta = delta * (1.0 / grad_p_units)
    store_rows_outputs(DELTA, GRAD_Q16, GRAD_Q_HALVES, GRAD_Q_SUMS, grad_q, delta, batch_head,
                       batch, head, m_start, SEQ_LEN, NUM_HEADS, HEAD_DIM, c.HALVES, SUM_ROWS,
                       BLOCK_M, c.row_vector, c.acc_layout)
