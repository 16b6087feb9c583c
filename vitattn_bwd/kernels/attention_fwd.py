"""Triton device code for the attention forward, FlashAttention-style. Per (batch, head),
with q, k, v [S,D] float32:

    attn_output = softmax(scale * q @ k^T) @ v        [S,D], stored with heads merged
    lse         = logsumexp(scale * q @ k^T, rows)    [S], natural log

A program owns BLOCK_M query rows and sweeps the keys BLOCK_N at a time with an online
softmax (running row max and sum, the output rescaled whenever the max grows). No S x S
tensor is written: the backward recomputes P tiles as exp(scale * q k^T - lse). The
exponentials are exp2 of base-2 logits (one more float32 multiply-add per score, the
hardware's native exponential). Both products are float32-grade "bf16x3" on tensor
cores (dot_bf16x3); q, k and v arrive split into bf16 hi / lo by the caller, so only
the probabilities tile is split here, in registers. Head dims that are not powers of
two run in tiles of the next one, zero-filled past HEAD_DIM on load and masked on store.

`attention_fwd_tile` holds the algorithm, so that a raw kernel (below, used eagerly and
tested under TRITON_INTERPRET=1) and an Inductor template can share it.
"""
import triton
import triton.language as tl

from .softmax_bwd import (dot_bf16x3, head_columns, head_tile_mask, load_pair,
                          padded_head_dim, program_block)

LOG2_E = tl.constexpr(1.4426950408889634)       # exp(x) == exp2(x * LOG2_E)
LN_2 = tl.constexpr(0.6931471805599453)         # log(x) == log2(x) * LN_2


@triton.jit
def head_tile_offsets(batch, head, offs_s, stride_b, stride_h, stride_s,
                      HEAD_DIM: tl.constexpr):
    """Offsets of rows `offs_s` of one (batch, head) of a [B,H,S,D] tensor with strides
    (stride_b, stride_h, stride_s, 1): [len, HEAD_TILE], int64 (the padding columns
    >= HEAD_DIM are the caller's to mask)."""
    head_start = batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    return (head_start + offs_s[:, None].to(tl.int64) * stride_s
            + head_columns(HEAD_DIM)[0][None, :])


@triton.jit
def attention_fwd_tile(Q_HI, Q_LO, K_HI, K_LO, V_HI, V_LO, stride_qb, stride_qh, stride_qs,
                       stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                       batch, head, m_start, scale, SEQ_LEN: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Query rows [m_start, m_start + BLOCK_M) of one (batch, head). Returns attn_output
    [BLOCK_M, HEAD_TILE] and lse [BLOCK_M] (rows past SEQ_LEN hold values of no meaning:
    the caller masks them; columns past HEAD_DIM are 0)."""
    HEAD_TILE: tl.constexpr = padded_head_dim(HEAD_DIM)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    q_hi, q_lo = load_pair(Q_HI, Q_LO, head_tile_offsets(batch, head, offs_m, stride_qb,
                                                         stride_qh, stride_qs, HEAD_DIM),
                           head_tile_mask(offs_m < SEQ_LEN, HEAD_DIM))    # [BM,D]
    scale_log2 = scale * LOG2_E

    # running state of the online softmax, in base-2 logits
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)   # max of the logits
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)           # sum exp2(logit - row_max)
    acc = tl.zeros((BLOCK_M, HEAD_TILE), dtype=tl.float32)     # sum exp2(..) * v
    for n_start in range(0, SEQ_LEN, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < SEQ_LEN
        kv_mask = head_tile_mask(key_ok, HEAD_DIM)
        k_hi, k_lo = load_pair(K_HI, K_LO, head_tile_offsets(batch, head, offs_n, stride_kb,
                                                             stride_kh, stride_ks,
                                                             HEAD_DIM),
                               kv_mask)                                   # [BN,D]
        v_hi, v_lo = load_pair(V_HI, V_LO, head_tile_offsets(batch, head, offs_n, stride_vb,
                                                             stride_vh, stride_vs,
                                                             HEAD_DIM),
                               kv_mask)                                   # [BN,D]
        q_dot_k = dot_bf16x3(q_hi, q_lo, tl.trans(k_hi), tl.trans(k_lo),
                             tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))  # [BM,BN]
        # keys past SEQ_LEN get probability 0. Every tile holds at least one real key
        # (n_start < SEQ_LEN), so row_max is finite from the first tile on.
        q_dot_k = tl.where(key_ok[None, :], q_dot_k, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(q_dot_k, axis=1) * scale_log2)   # scale > 0
        rescale = tl.exp2(row_max - new_max)                              # [BM], 0 at first
        p = tl.exp2(q_dot_k * scale_log2 - new_max[:, None])              # [BM,BN] in [0,1]
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        p_hi = p.to(tl.bfloat16)                             # split in registers
        p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
        acc = dot_bf16x3(p_hi, p_lo, v_hi, v_lo, acc * rescale[:, None])  # [BM,D]
        row_max = new_max
    attn_output = acc / row_sum[:, None]
    lse = (row_max + tl.log2(row_sum)) * LN_2
    return attn_output, lse


# ---- raw kernel: one program per query block of each (batch, head) ------------------

@triton.jit
def attention_fwd_kernel(Q_HI, Q_LO, K_HI, K_LO, V_HI, V_LO, ATTN_OUTPUT, LSE,
                         stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                         stride_vb, stride_vh, stride_vs, scale, SEQ_LEN: tl.constexpr,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """ATTN_OUTPUT [B,S,H*D] (heads merged), LSE [B,H,S], both contiguous float32."""
    batch, head, m_start = program_block(SEQ_LEN, NUM_HEADS, BLOCK_M)
    attn_output, lse = attention_fwd_tile(
        Q_HI, Q_LO, K_HI, K_LO, V_HI, V_LO, stride_qb, stride_qh, stride_qs, stride_kb,
        stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, batch, head, m_start, scale,
        SEQ_LEN, HEAD_DIM, BLOCK_M, BLOCK_N)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < SEQ_LEN
    # [B,S,E] seen as [B,H,S,D]: strides (S*E, D, E, 1)
    tl.store(ATTN_OUTPUT + head_tile_offsets(batch, head, offs_m,
                                             SEQ_LEN * NUM_HEADS * HEAD_DIM, HEAD_DIM,
                                             NUM_HEADS * HEAD_DIM, HEAD_DIM),
             attn_output, mask=head_tile_mask(row_ok, HEAD_DIM))
    tl.store(LSE + (batch * NUM_HEADS + head).to(tl.int64) * SEQ_LEN + offs_m, lse,
             mask=row_ok)
