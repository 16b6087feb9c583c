"""Triton device code for the attention core of the backward.

Inputs per (batch, head): P [S,S] (float32, at PROBS), dO = grad_attn [S,D] (read
with head strides from the [B,S,E] out-projection gradient), q, k, v [S,D]. With
RECOMPUTE_P the kernels read P's row log-sum-exp lse [S] (at LSE) instead of P and
recompute each P tile as exp(scale * q k^T - lse), from the same bf16x3 product as the
forward (kernels/attention_fwd.py): no [S,S] tensor is read at all. Outputs:

    dP    = dO @ v^T                         (never stored)
    delta = rowsum(P * dP)                   [S]
    dQ    = (P*dP) @ k - delta * (P @ k)     = (P * (dP - delta)) @ k, times scale
    dV    = P^T @ dO
    dK    = (P * (dP - delta))^T @ q, times scale

Two passes over P, no S x S tensor in memory:
  rows pass: a program owns BLOCK_M query rows, sweeps all keys once and gets delta and
             dQ together, because dQ is linear in the two running sums above. With
             RECOMPUTE_P, P and the attention output O [S,D] come from one forward, so
             delta = rowsum(P * (dO v^T)) = rowsum(dO * O) is known before the sweep (as
             in FlashAttention's backward) and dQ takes one product with k, not two;
  cols pass: a program owns BLOCK_N key rows, sweeps all queries with delta known and
             gets dK and dV. It works on transposed tiles (P^T, dP^T), as the Triton
             fused-attention tutorial does, so every dot takes its operands as stored.
No atomics: each output element is written by exactly one program (deterministic).

Precision: every product is float32-grade "bf16x3" (each float32 operand split into
bf16 hi + lo, a @ b = a_lo@b_hi + a_hi@b_lo + a_hi@b_hi with float32 accumulation).
(dK as one fp16 product, which the contract's tolerance allows, measured no faster on
the H200 and cost accuracy.) dO, q, k and v arrive already
split (two bf16 tensors each, made once by the caller), so their tiles go from memory
straight to the tensor cores; only the S x S tiles (P and the products with it) are
split here, in registers.

The outputs are written in the formats their consumers read, so no kernel reads them
again to convert them: each gradient as fp16 (the QKV weight-gradient GEMM's operand),
as bf16 [hi | lo] halves of one row (the QKV input-gradient GEMM's bf16x3 operand), and
as float32 sums over each program's rows (partial sums of the QKV bias gradient,
which the graph adds in a fixed order).

Any head dim D that is a multiple of 8 up to 128 runs: every [.., D] tile is
HEAD_TILE = padded_head_dim(D) wide (tensor shapes must be powers of two; tl.dot's K
at least 16), loaded with zeros in the columns >= D, which add nothing to any product,
and stored with those columns masked off.

The `*_tile` and store functions hold the algorithm. They are shared verbatim by the raw
kernels below (used eagerly and tested under TRITON_INTERPRET=1) and by the Inductor
templates (vitattn_bwd/inductor.py pastes every non-kernel function of this file into
its templates).
"""
import triton
import triton.language as tl


@triton.constexpr_function
def padded_head_dim(head_dim):
    """The width of the kernels' [.., head_dim] tiles: the next power of two, at least
    16 (the K of a tensor-core product)."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def head_columns(HEAD_DIM: tl.constexpr):
    """The columns of a head tile, [HEAD_TILE], and which of them are real (< HEAD_DIM)."""
    cols = tl.arange(0, padded_head_dim(HEAD_DIM))
    return cols, cols < HEAD_DIM


@triton.jit
def head_tile_mask(row_ok, HEAD_DIM: tl.constexpr):
    """The mask of a [len(row_ok), HEAD_TILE] head tile: its rows' row_ok, and its real
    columns where HEAD_DIM is padded. (At a power of two the mask stays [len, 1]: a
    [len, HEAD_TILE] one, though all true, cost the cols pass 200-340 bytes of spills.)"""
    mask = row_ok[:, None]
    if padded_head_dim(HEAD_DIM) != HEAD_DIM:
        mask = mask & head_columns(HEAD_DIM)[1][None, :]
    return mask


@triton.jit
def head_columns_at(head, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Column of each element of a head tile's row in a [.., E] row whose E = NUM_HEADS
    * HEAD_DIM columns hold the heads side by side, [HEAD_TILE]; the padding columns get
    E, past the row, which the stores' `< E` masks drop."""
    cols = head * HEAD_DIM + head_columns(HEAD_DIM)[0]
    if padded_head_dim(HEAD_DIM) != HEAD_DIM:
        cols = tl.where(head_columns(HEAD_DIM)[1], cols, NUM_HEADS * HEAD_DIM)
    return cols


@triton.jit
def split_bf16_rounded(x):
    """float32 tile -> (hi, lo) bf16 tiles: hi = x rounded to bf16, lo = the rest rounded;
    hi + lo == x to about 16 mantissa bits."""
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def dot_bf16x3(a_hi, a_lo, b_hi, b_lo, acc):
    """acc + a @ b from split operands; the small cross terms go first."""
    acc = tl.dot(a_lo, b_hi, acc)
    acc = tl.dot(a_hi, b_lo, acc)
    acc = tl.dot(a_hi, b_hi, acc)
    return acc


@triton.jit
def load_pair(HI, LO, offsets, mask):
    """The bf16 (hi, lo) tiles of a pre-split float32 tensor at `offsets`."""
    return (tl.load(HI + offsets, mask=mask, other=0.0),
            tl.load(LO + offsets, mask=mask, other=0.0))


@triton.jit
def store_bf16_halves(HALVES, offsets, lo_offset, value, mask):
    """Store a float32 tile as its rounded bf16 hi part at `offsets` and lo part at
    `offsets + lo_offset` (the [hi | lo] halves of a row of the consumer's operand)."""
    hi, lo = split_bf16_rounded(value)
    tl.store(HALVES + offsets, hi, mask=mask)
    tl.store(HALVES + offsets + lo_offset, lo, mask=mask)


@triton.jit
def head_rows(batch, head, offs, SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr,
              HEAD_DIM: tl.constexpr, ROW_WIDTH: tl.constexpr):
    """Offsets of rows `offs` of one head in a [B,S,ROW_WIDTH] layout whose first
    NUM_HEADS * HEAD_DIM columns hold the heads side by side: [len,HEAD_TILE] (the
    padding columns >= HEAD_DIM are the caller's to mask)."""
    return ((batch * SEQ_LEN + offs[:, None]).to(tl.int64) * ROW_WIDTH
            + head * HEAD_DIM + head_columns(HEAD_DIM)[0][None, :])


@triton.jit
def load_vector(base, start, SEQ_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """base[start : start + BLOCK], 0 past SEQ_LEN."""
    offs = start + tl.arange(0, BLOCK)
    return tl.load(base + offs, mask=offs < SEQ_LEN, other=0.0)


@triton.jit
def load_probs_tile(rows, row_ok, col_start, col_stride, SEQ_LEN: tl.constexpr,
                    BLOCK: tl.constexpr):
    """A [len(rows), BLOCK] tile of P (or of P^T): element (i, j) at rows[i] +
    (col_start + j) * col_stride, 0 outside the SEQ_LEN x SEQ_LEN matrix.

    The cols pass loads the NEXT iteration's P^T tile (and its delta) one iteration
    ahead, before working on the current one: Triton's loop pipeliner prefetches only
    tl.dot operands, and a plain load used in the same iteration stalls the program for a
    memory round trip (H200, batch 32: cols 0.82 -> 0.74 ms). The rows pass loads in
    place: there the prefetch's extra registers cost more than it hid (its best tiles
    0.63 -> 0.69 ms)."""
    offs = col_start + tl.arange(0, BLOCK)
    return tl.load(rows + offs[None, :] * col_stride,
                   mask=row_ok[:, None] & (offs < SEQ_LEN)[None, :], other=0.0)


@triton.jit
def recomputed_probabilities(a_hi, a_lo, b_hi, b_lo, lse_log2, scale, valid, zeros):
    """exp(scale * a @ b^T - lse) from split operands, 0 where not `valid`; lse_log2 is
    lse * log2(e), shaped to broadcast over the tile."""
    logits = dot_bf16x3(a_hi, a_lo, tl.trans(b_hi), tl.trans(b_lo), zeros)
    probabilities = tl.exp2(logits * (scale * 1.4426950408889634) - lse_log2)
    return tl.where(valid, probabilities, 0.0)


@triton.jit
def softmax_bwd_rows_tile(PROBS, LSE, grad_attn, q, k, v, ATTN_OUT, batch, head, m_start,
                          scale, SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, RECOMPUTE_P: tl.constexpr):
    """Rows pass for query rows [m_start, m_start + BLOCK_M) of one (batch, head), the
    operands given as their (hi, lo) pointer pairs; P is read from PROBS, or with
    RECOMPUTE_P recomputed from LSE (then q and the attention output ATTN_OUT [B,S,E] are
    read; otherwise LSE, q and ATTN_OUT are unused). Returns grad_q [BLOCK_M, HEAD_TILE]
    and delta [BLOCK_M] (rows past SEQ_LEN and columns past HEAD_DIM are 0)."""
    HEAD_TILE: tl.constexpr = padded_head_dim(HEAD_DIM)
    batch_head = (batch * NUM_HEADS + head).to(tl.int64)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = head_columns(HEAD_DIM)[0]
    row_ok = offs_m < SEQ_LEN
    head_rows_m = head_rows(batch, head, offs_m, SEQ_LEN, NUM_HEADS, HEAD_DIM,
                            NUM_HEADS * HEAD_DIM)
    rows_mask = head_tile_mask(row_ok, HEAD_DIM)                          # [BM,D]
    grad_attn_hi, grad_attn_lo = load_pair(*grad_attn, head_rows_m, rows_mask)  # [BM,D]

    p_rows = PROBS + batch_head * SEQ_LEN * SEQ_LEN + offs_m[:, None] * SEQ_LEN
    head_start = batch_head * SEQ_LEN * HEAD_DIM
    if RECOMPUTE_P:
        q_hi, q_lo = load_pair(*q, head_start + offs_m[:, None] * HEAD_DIM
                               + offs_d[None, :], rows_mask)              # [BM,D]
        lse_log2 = load_vector(LSE + batch_head * SEQ_LEN, m_start, SEQ_LEN,
                               BLOCK_M) * 1.4426950408889634              # [BM]
        attn_out = tl.load(ATTN_OUT + head_rows_m, mask=rows_mask, other=0.0)
        grad_attn = grad_attn_hi.to(tl.float32) + grad_attn_lo.to(tl.float32)
        delta = tl.sum(grad_attn * attn_out, axis=1)                      # [BM]
    else:
        delta = tl.zeros((BLOCK_M,), dtype=tl.float32)                    # summed below

    # grad_s_k sums (P * (dP - delta)) @ k with RECOMPUTE_P (delta known), else (P * dP) @ k
    # while p_k sums P @ k, and dQ = grad_s_k - delta * p_k once delta is complete.
    grad_s_k = tl.zeros((BLOCK_M, HEAD_TILE), dtype=tl.float32)
    if not RECOMPUTE_P:
        p_k = tl.zeros((BLOCK_M, HEAD_TILE), dtype=tl.float32)
    for n_start in range(0, SEQ_LEN, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < SEQ_LEN
        kv_offsets = head_start + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = head_tile_mask(col_ok, HEAD_DIM)
        k_hi, k_lo = load_pair(*k, kv_offsets, kv_mask)                   # [BN,D]
        v_hi, v_lo = load_pair(*v, kv_offsets, kv_mask)                   # [BN,D]
        if RECOMPUTE_P:
            p = recomputed_probabilities(
                q_hi, q_lo, k_hi, k_lo, lse_log2[:, None], scale,
                row_ok[:, None] & col_ok[None, :],
                tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))           # [BM,BN]
        else:
            p = load_probs_tile(p_rows, row_ok, n_start, 1, SEQ_LEN, BLOCK_N)  # [BM,BN]
        grad_p = dot_bf16x3(grad_attn_hi, grad_attn_lo, tl.trans(v_hi), tl.trans(v_lo),
                            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))  # [BM,BN]
        if RECOMPUTE_P:
            grad_s = p * (grad_p - delta[:, None])
        else:
            grad_s = p * grad_p
            delta += tl.sum(grad_s, axis=1)
        gs_hi, gs_lo = split_bf16_rounded(grad_s)
        grad_s_k = dot_bf16x3(gs_hi, gs_lo, k_hi, k_lo, grad_s_k)
        if not RECOMPUTE_P:
            p_hi, p_lo = split_bf16_rounded(p)
            p_k = dot_bf16x3(p_hi, p_lo, k_hi, k_lo, p_k)
    if RECOMPUTE_P:
        grad_q = grad_s_k * scale
    else:
        grad_q = (grad_s_k - delta[:, None] * p_k) * scale
    return grad_q, delta


@triton.jit
def softmax_bwd_cols_tile(PROBS, LSE, grad_attn, q, k, v, DELTA, batch, head, n_start,
                          scale, SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, RECOMPUTE_P: tl.constexpr):
    """Cols pass for key rows [n_start, n_start + BLOCK_N) of one (batch, head), with
    delta from the rows pass, the operands given as their (hi, lo) pointer pairs; P is
    read from PROBS, or with RECOMPUTE_P recomputed from LSE (then k is read; otherwise
    LSE and k are unused). Returns grad_k, grad_v [BLOCK_N, HEAD_TILE] (columns past
    HEAD_DIM 0)."""
    HEAD_TILE: tl.constexpr = padded_head_dim(HEAD_DIM)
    batch_head = (batch * NUM_HEADS + head).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = head_columns(HEAD_DIM)[0]
    col_ok = offs_n < SEQ_LEN
    kv_mask = head_tile_mask(col_ok, HEAD_DIM)                            # [BN,D]
    head_start = batch_head * SEQ_LEN * HEAD_DIM
    v_hi, v_lo = load_pair(*v, head_start + offs_n[:, None] * HEAD_DIM
                           + offs_d[None, :], kv_mask)                    # [BN,D]

    p_t_cols = PROBS + batch_head * SEQ_LEN * SEQ_LEN + offs_n[:, None]   # P^T rows
    if RECOMPUTE_P:
        k_hi, k_lo = load_pair(*k, head_start + offs_n[:, None] * HEAD_DIM
                               + offs_d[None, :], kv_mask)                # [BN,D]
        lse_head = LSE + batch_head * SEQ_LEN
        lse_next = load_vector(lse_head, 0, SEQ_LEN, BLOCK_M)
    else:
        p_t_next = load_probs_tile(p_t_cols, col_ok, 0, SEQ_LEN, SEQ_LEN,
                                   BLOCK_M)                               # [BN,BM]
    delta_head = DELTA + batch_head * SEQ_LEN
    delta_next = load_vector(delta_head, 0, SEQ_LEN, BLOCK_M)             # [BM]

    grad_k = tl.zeros((BLOCK_N, HEAD_TILE), dtype=tl.float32)
    grad_v = tl.zeros((BLOCK_N, HEAD_TILE), dtype=tl.float32)
    for m_start in range(0, SEQ_LEN, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < SEQ_LEN
        rows_mask = head_tile_mask(row_ok, HEAD_DIM)
        grad_attn_hi, grad_attn_lo = load_pair(
            *grad_attn, head_rows(batch, head, offs_m, SEQ_LEN, NUM_HEADS, HEAD_DIM,
                                  NUM_HEADS * HEAD_DIM), rows_mask)       # [BM,D]
        q_hi, q_lo = load_pair(*q, head_start + offs_m[:, None] * HEAD_DIM
                               + offs_d[None, :], rows_mask)              # [BM,D]
        delta = delta_next
        delta_next = load_vector(delta_head, m_start + BLOCK_M, SEQ_LEN, BLOCK_M)
        if RECOMPUTE_P:
            lse = lse_next
            lse_next = load_vector(lse_head, m_start + BLOCK_M, SEQ_LEN, BLOCK_M)
            p_t = recomputed_probabilities(
                k_hi, k_lo, q_hi, q_lo, lse[None, :] * 1.4426950408889634, scale,
                col_ok[:, None] & row_ok[None, :],
                tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))           # [BN,BM]
        else:
            p_t = p_t_next
            p_t_next = load_probs_tile(p_t_cols, col_ok, m_start + BLOCK_M,
                                       SEQ_LEN, SEQ_LEN, BLOCK_M)

        p_t_hi, p_t_lo = split_bf16_rounded(p_t)
        grad_v = dot_bf16x3(p_t_hi, p_t_lo, grad_attn_hi, grad_attn_lo, grad_v)
        grad_p_t = dot_bf16x3(v_hi, v_lo, tl.trans(grad_attn_hi), tl.trans(grad_attn_lo),
                              tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))  # [BN,BM]
        grad_s_t = p_t * (grad_p_t - delta[None, :])                      # [BN,BM]
        gs_t_hi, gs_t_lo = split_bf16_rounded(grad_s_t)
        grad_k = dot_bf16x3(gs_t_hi, gs_t_lo, q_hi, q_lo, grad_k)
    return grad_k * scale, grad_v


@triton.jit
def store_grad_q_halves(GRAD_Q_HALVES, grad_q, batch, head, m_start,
                        SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """grad_q [BM,HEAD_TILE] into the [B,S,2E] [hi | lo] layout."""
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offsets = head_rows(batch, head, offs_m, SEQ_LEN, NUM_HEADS, HEAD_DIM,
                        2 * NUM_HEADS * HEAD_DIM)
    store_bf16_halves(GRAD_Q_HALVES, offsets, NUM_HEADS * HEAD_DIM, grad_q,
                      head_tile_mask(offs_m < SEQ_LEN, HEAD_DIM))


@triton.jit
def store_delta(DELTA, delta, batch, head, m_start, SEQ_LEN: tl.constexpr,
                NUM_HEADS: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_m = m_start + tl.arange(0, BLOCK_M)
    tl.store(DELTA + (batch * NUM_HEADS + head).to(tl.int64) * SEQ_LEN + offs_m, delta,
             mask=offs_m < SEQ_LEN)


@triton.jit
def join_kv(grad_k, grad_v, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Two [BN,HEAD_TILE] tiles -> one [BN,2*HEAD_TILE] tile, grad_k in the first half
    of each row."""
    return tl.reshape(tl.permute(tl.join(grad_k, grad_v), (0, 2, 1)),
                      (BLOCK_N, 2 * padded_head_dim(HEAD_DIM)))


@triton.jit
def kv_columns(head, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Column of each element of a join_kv tile in a [B,S,2E] (dK | dV) layout; the
    padding columns (>= HEAD_DIM of either half) get 2E, past the row, which the stores'
    `< 2E` masks drop."""
    HEAD_TILE: tl.constexpr = padded_head_dim(HEAD_DIM)
    j = tl.arange(0, 2 * HEAD_TILE)
    cols = (j // HEAD_TILE) * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + j % HEAD_TILE
    if HEAD_TILE != HEAD_DIM:
        cols = tl.where(j % HEAD_TILE < HEAD_DIM, cols, 2 * NUM_HEADS * HEAD_DIM)
    return cols


@triton.jit
def store_grad_kv_halves(GRAD_KV_HALVES, grad_kv, batch, head, n_start,
                         SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """A join_kv tile [BN,2*HEAD_TILE] into the [B,S,4E] [k_hi v_hi | k_lo v_lo] layout."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    cols = kv_columns(head, NUM_HEADS, HEAD_DIM)
    offsets = ((batch * SEQ_LEN + offs_n[:, None]).to(tl.int64) * (4 * NUM_HEADS * HEAD_DIM)
               + cols[None, :])
    store_bf16_halves(GRAD_KV_HALVES, offsets, 2 * NUM_HEADS * HEAD_DIM, grad_kv,
                      (offs_n < SEQ_LEN)[:, None] & (cols < 2 * NUM_HEADS * HEAD_DIM)[None, :])


@triton.jit
def store_column_sums(SUMS, grad, batch, row_start, cols, SEQ_LEN: tl.constexpr,
                      BLOCK: tl.constexpr, SUMS_WIDTH: tl.constexpr,
                      SUM_ROWS: tl.constexpr):
    """The sum over rows of a gradient tile grad [BLOCK, N] of rows [row_start, +BLOCK)
    of one batch element (rows past SEQ_LEN left out), a partial sum of the QKV bias
    gradient, into SUMS [B, cdiv(SEQ_LEN, SUM_ROWS), SUMS_WIDTH] at columns `cols` [N]
    (those >= SUMS_WIDTH, the padding of a head tile, left out):
    at the group of SUM_ROWS rows where the tile starts, and zeros at the other groups it
    covers, so that every block size fills the same buffer."""
    tl.static_assert(BLOCK % SUM_ROWS == 0)
    GROUPS: tl.constexpr = (SEQ_LEN + SUM_ROWS - 1) // SUM_ROWS
    rows = row_start + tl.arange(0, BLOCK)
    sums = tl.sum(tl.where((rows < SEQ_LEN)[:, None], grad, 0.0), axis=0)  # [N]
    for part in tl.static_range(BLOCK // SUM_ROWS):
        group = row_start // SUM_ROWS + part
        if group < GROUPS:          # a branch: triton 3.9's interpreter takes no scalar mask
            tl.store(SUMS + (batch * GROUPS + group).to(tl.int64) * SUMS_WIDTH + cols,
                     sums if part == 0 else tl.zeros_like(sums), mask=cols < SUMS_WIDTH)


# ---- one program of each pass, shared by the raw kernels and the Inductor templates ---
# Each stores every output but its fp16 gradient and returns where that goes, so that the
# raw kernel stores it with tl.store and the template (inductor.py) with store_output.

@triton.jit
def program_block(SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """(batch, head, first row of its block) of this program on a 1-D grid of
    cdiv(SEQ_LEN, BLOCK) * batch * NUM_HEADS programs, a head's blocks adjacent: the
    grid's first dimension takes any batch * heads (CUDA caps the others at 65,535)."""
    blocks: tl.constexpr = (SEQ_LEN + BLOCK - 1) // BLOCK
    batch_head = tl.program_id(0) // blocks
    return batch_head // NUM_HEADS, batch_head % NUM_HEADS, (tl.program_id(0) % blocks) * BLOCK


@triton.jit
def softmax_bwd_rows_program(PROBS, LSE, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI,
                             K_LO, V_HI, V_LO, ATTN_OUT, DELTA, GRAD_Q_HALVES, GRAD_Q_SUMS,
                             scale, SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, RECOMPUTE_P: tl.constexpr,
                             SUM_ROWS: tl.constexpr):
    """The rows pass of one query block of one head (program_block): stores delta,
    grad_q's bf16 halves and its partial column sums; returns (batch, rows [BM,1],
    columns [1,HEAD_TILE] in grad_q16 [B,S,E] (E past the row for the padding columns),
    grad_q [BM,HEAD_TILE] in fp16)."""
    batch, head, m_start = program_block(SEQ_LEN, NUM_HEADS, BLOCK_M)
    grad_q, delta = softmax_bwd_rows_tile(PROBS, LSE, (GRAD_ATTN_HI, GRAD_ATTN_LO),
                                          (Q_HI, Q_LO), (K_HI, K_LO), (V_HI, V_LO),
                                          ATTN_OUT, batch, head, m_start, scale, SEQ_LEN,
                                          NUM_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N,
                                          RECOMPUTE_P)
    store_delta(DELTA, delta, batch, head, m_start, SEQ_LEN, NUM_HEADS, BLOCK_M)
    store_grad_q_halves(GRAD_Q_HALVES, grad_q, batch, head, m_start, SEQ_LEN, NUM_HEADS,
                        HEAD_DIM, BLOCK_M)
    cols = head_columns_at(head, NUM_HEADS, HEAD_DIM)                     # [HEAD_TILE]
    store_column_sums(GRAD_Q_SUMS, grad_q, batch, m_start, cols, SEQ_LEN, BLOCK_M,
                      NUM_HEADS * HEAD_DIM, SUM_ROWS)
    rows = m_start + tl.arange(0, BLOCK_M)[:, None]
    return batch, rows, cols[None, :], grad_q.to(tl.float16)


@triton.jit
def softmax_bwd_cols_program(PROBS, LSE, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI,
                             K_LO, V_HI, V_LO, DELTA, GRAD_KV_HALVES, GRAD_KV_SUMS, scale,
                             SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, RECOMPUTE_P: tl.constexpr,
                             SUM_ROWS: tl.constexpr):
    """The cols pass of one key block of one head (program_block): stores grad_k's
    and grad_v's bf16 halves and their partial column sums; returns (batch, rows [BN,1],
    columns [1,2*HEAD_TILE] in grad_kv16 [B,S,2E] (2E for the padding columns),
    [grad_k | grad_v] [BN,2*HEAD_TILE] in fp16)."""
    batch, head, n_start = program_block(SEQ_LEN, NUM_HEADS, BLOCK_N)
    grad_k, grad_v = softmax_bwd_cols_tile(PROBS, LSE, (GRAD_ATTN_HI, GRAD_ATTN_LO),
                                           (Q_HI, Q_LO), (K_HI, K_LO), (V_HI, V_LO), DELTA,
                                           batch, head, n_start, scale, SEQ_LEN, NUM_HEADS,
                                           HEAD_DIM, BLOCK_M, BLOCK_N, RECOMPUTE_P)
    grad_kv = join_kv(grad_k, grad_v, BLOCK_N, HEAD_DIM)                  # [BN,2D]
    store_grad_kv_halves(GRAD_KV_HALVES, grad_kv, batch, head, n_start, SEQ_LEN,
                         NUM_HEADS, HEAD_DIM, BLOCK_N)
    store_column_sums(GRAD_KV_SUMS, grad_kv, batch, n_start,
                      kv_columns(head, NUM_HEADS, HEAD_DIM), SEQ_LEN, BLOCK_N,
                      2 * NUM_HEADS * HEAD_DIM, SUM_ROWS)
    rows = n_start + tl.arange(0, BLOCK_N)[:, None]
    cols = kv_columns(head, NUM_HEADS, HEAD_DIM)[None, :]
    return batch, rows, cols, grad_kv.to(tl.float16)


# ---- raw kernels: one program per row or column block of each (batch, head) ---------

@triton.jit
def softmax_bwd_rows_kernel(PROBS, LSE, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI,
                            K_LO, V_HI, V_LO, ATTN_OUT, GRAD_Q16, GRAD_Q_HALVES, DELTA,
                            GRAD_Q_SUMS, scale, SEQ_LEN: tl.constexpr,
                            NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            RECOMPUTE_P: tl.constexpr, SUM_ROWS: tl.constexpr):
    batch, rows, cols, grad_q16 = softmax_bwd_rows_program(
        PROBS, LSE, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO, V_HI, V_LO, ATTN_OUT,
        DELTA, GRAD_Q_HALVES, GRAD_Q_SUMS, scale, SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M,
        BLOCK_N, RECOMPUTE_P, SUM_ROWS)
    tl.store(GRAD_Q16 + (batch * SEQ_LEN + rows).to(tl.int64) * (NUM_HEADS * HEAD_DIM)
             + cols, grad_q16, mask=(rows < SEQ_LEN) & (cols < NUM_HEADS * HEAD_DIM))


@triton.jit
def softmax_bwd_cols_kernel(PROBS, LSE, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI,
                            K_LO, V_HI, V_LO, DELTA, GRAD_KV16, GRAD_KV_HALVES, GRAD_KV_SUMS,
                            scale, SEQ_LEN: tl.constexpr, NUM_HEADS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, RECOMPUTE_P: tl.constexpr,
                            SUM_ROWS: tl.constexpr):
    batch, rows, cols, grad_kv16 = softmax_bwd_cols_program(
        PROBS, LSE, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO, V_HI, V_LO, DELTA,
        GRAD_KV_HALVES, GRAD_KV_SUMS, scale, SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M,
        BLOCK_N, RECOMPUTE_P, SUM_ROWS)
    tl.store(GRAD_KV16 + (batch * SEQ_LEN + rows).to(tl.int64) * (2 * NUM_HEADS * HEAD_DIM)
             + cols, grad_kv16, mask=(rows < SEQ_LEN) & (cols < 2 * NUM_HEADS * HEAD_DIM))
