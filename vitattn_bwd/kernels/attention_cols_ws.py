"""Gluon device code for the cols pass of the attention-core backward (dK, dV of one key
block, P given) warp-specialized on Hopper (sm_90): the math and the outputs of
kernels/softmax_bwd_gluon.py's cols kernel with P given, where a producer warp feeds
the operand tiles by TMA and the products of both consumer warpgroups stay in flight.

A program owns BLOCK_N = 128 keys of one (batch, head) (program ids: key block,
batch * NUM_HEADS + head, the two-pass cols kernel's grid), in two partitions:

    producer (one warp, few registers): TMA  v [BN,D] (hi and lo) once; then q_m, dO_m
        [BM,D] (hi and lo) of every query tile into a NUM_STAGES-deep ring, each slot
        guarded by a ready and an empty mbarrier
    consumers (two warpgroups, 64 keys each: keys in rows), query tile m:
        issue  dP^T = v @ dO_m^T                              [BN,BM]
        wait   for dV of tile m-1 (it reads the P^T registers reused next)
               P^T_m: loaded a tile ahead into the accumulator's registers, zero past
               the sequence's queries
        issue  dV += P^T @ dO_m                               [BN,D]
        load   P^T_{m+1} (registers); the L2 asked for the tiles PREFETCH ahead of it
        wait   for dP^T (dV in flight), and with it dK of tile m-1: give slot m-1 back
        dS^T = P^T * (dP^T - delta_m)
        issue  dK += dS^T @ q_m                               [BN,D]
    at the end: dK * scale and dV stored as the two-pass cols kernel stores them

Three products per matmul (bf16x3 on bf16 halves, small terms first:
softmax_bwd_gluon.issue_products), the contract's precision "high"; the P^T and dS^T
tiles are split in registers into the A operands of dV and dK (split_operand), so
neither goes through shared memory. Two waits per tile, each leaving products in flight.
At 64-query tiles ptxas spilled 340 bytes (100 in the walk) of the consumers' 240
registers; 32-query tiles spill nothing (tests/test_attention_cols_ws.py).

The operand tiles come by TMA, which has no per-head bound: the rows of a tile past
the sequence end are the next head's (or batch element's) rows, or zeros past the
tensor's end. Where it matters their P^T columns are zeroed (queries past the end add
nothing to dK and dV: finite rows, as in kernels/attention_bwd_ws.py, where a NaN or
inf in a neighbour's first rows would reach through a zero P^T column), and the keys
past the end are never stored (their rows of dK and dV are left out of the stores and
the column sums). P's rows (577 floats) are
4-byte aligned only, so P is loaded by the consumers, as in the two-pass kernels,
from clamped indices (softmax_bwd_gluon.clamped).

Not yet run on a GPU: compiled for sm_90 on the CPU (tests/test_attention_cols_ws.py
checks its machine code); scripts/time_core_cols_ws.py checks it against float64 and
the two-pass cols kernels and times it on the H200.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma_wait)

from .attention_bwd_ws import head_coordinates
from .gluon_compat import cta_barrier, tma_load
from .softmax_bwd_gluon import (clamped, cols_carried_values, issue_products, load_vector,
                                next_p_t_tile, prefetch_to_l2, split_operand,
                                store_cols_outputs, tile_parts, wgmma_layout)


@gluon.jit
def cols_load_partition(q_hi_desc, q_lo_desc, grad_attn_hi_desc, grad_attn_lo_desc,
                        v_hi_desc, v_lo_desc, own, ring_q, ring_grad_attn, own_ready, ready,
                        empty, NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                        HEADS_IN_ROWS: gl.constexpr):
    """The producer: the program's v tiles, then every query tile's q and dO through
    the ring, in order."""
    NUM_TILES: gl.constexpr = (SEQ_LEN + BLOCK_M - 1) // BLOCK_M
    batch_head = gl.program_id(1)
    n_start = gl.program_id(0) * BLOCK_N
    qkv_row, qkv_col = head_coordinates(batch_head, NUM_HEADS, SEQ_LEN, HEAD_DIM,
                                        HEADS_IN_ROWS)
    do_row, do_col = head_coordinates(batch_head, NUM_HEADS, SEQ_LEN, HEAD_DIM, False)
    mbarrier.expect(own_ready, 2 * v_hi_desc.block_type.nbytes)
    tma_load(v_hi_desc, [qkv_row + n_start, qkv_col], own_ready, own.index(0))
    tma_load(v_lo_desc, [qkv_row + n_start, qkv_col], own_ready, own.index(1))
    for m_tile in range(NUM_TILES):
        slot = m_tile % NUM_STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0
        mbarrier.wait(empty.index(slot), ((m_tile // NUM_STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * (q_hi_desc.block_type.nbytes
                                  + grad_attn_hi_desc.block_type.nbytes))
        q_hi, q_lo = tile_parts(ring_q, slot, 2)
        grad_attn_hi, grad_attn_lo = tile_parts(ring_grad_attn, slot, 2)
        tma_load(q_hi_desc, [qkv_row + m_tile * BLOCK_M, qkv_col], bar, q_hi)
        tma_load(q_lo_desc, [qkv_row + m_tile * BLOCK_M, qkv_col], bar, q_lo)
        tma_load(grad_attn_hi_desc, [do_row + m_tile * BLOCK_M, do_col], bar, grad_attn_hi)
        tma_load(grad_attn_lo_desc, [do_row + m_tile * BLOCK_M, do_col], bar, grad_attn_lo)


@gluon.jit
def cols_compute_partition(PROBS, DELTA, GRAD_KV16, GRAD_KV_HALVES, GRAD_KV_SUMS, scale, own,
                           ring_q, ring_grad_attn, own_ready, ready, empty,
                           NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                           PREFETCH: gl.constexpr, SUM_ROWS: gl.constexpr,
                           num_warps: gl.constexpr):
    """The consumers: three products per query tile (module docstring) with P^T, dP^T
    and dS^T [BN,BM] in registers, then dK and dV of the program's keys stored."""
    NUM_TILES: gl.constexpr = (SEQ_LEN + BLOCK_M - 1) // BLOCK_M
    PRODUCTS: gl.constexpr = 3
    dtype: gl.constexpr = own.dtype                                       # bf16
    tile_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_M)      # [BN,BM]
    acc_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DIM)      # [BN,D]: dK, dV
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                 k_width=2)
    key_vector: gl.constexpr = gl.SliceLayout(1, tile_layout)
    query_vector: gl.constexpr = gl.SliceLayout(0, tile_layout)

    batch_head = gl.program_id(1)
    batch = batch_head // NUM_HEADS
    head = batch_head % NUM_HEADS
    n_start = gl.program_id(0) * BLOCK_N
    keys = n_start + gl.arange(0, BLOCK_N, layout=key_vector)
    probs_head = PROBS + batch_head.to(gl.int64) * SEQ_LEN * SEQ_LEN
    delta_head = DELTA + batch_head.to(gl.int64) * SEQ_LEN
    # P^T tiles [BN,BM]: element (key, query) at query * SEQ_LEN + key
    key_offsets = clamped(keys, SEQ_LEN)[:, None]
    tile_queries = gl.arange(0, BLOCK_M, layout=query_vector)
    p_t_next = gl.load(probs_head + key_offsets
                       + (clamped(tile_queries, SEQ_LEN) * SEQ_LEN)[None, :])
    for ahead in gl.static_range(1, PREFETCH + 1):
        prefetch_to_l2(probs_head, ahead * BLOCK_M, n_start, SEQ_LEN, BLOCK_M, BLOCK_N,
                       num_warps)
    zeros_tile = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=tile_layout)
    grad_k, grad_v, p_t_hi, p_t_lo, grad_s_t_hi, grad_s_t_lo = cols_carried_values(
        BLOCK_N, BLOCK_M, HEAD_DIM, dtype, acc_layout, a_layout)
    mbarrier.wait(own_ready, 0)
    v_hi, v_lo = tile_parts(own, 0, 2)                                # [BN,D]
    for m_tile in range(NUM_TILES):
        slot = m_tile % NUM_STAGES
        m_start = m_tile * BLOCK_M
        queries = m_start + tile_queries
        delta = load_vector(delta_head, m_start, SEQ_LEN, BLOCK_M, query_vector)
        mbarrier.wait(ready.index(slot), (m_tile // NUM_STAGES) & 1)
        q_hi, q_lo = tile_parts(ring_q, slot, 2)                          # [BM,D]
        grad_attn_hi, grad_attn_lo = tile_parts(ring_grad_attn, slot, 2)
        grad_p_t = issue_products(v_hi, v_lo, grad_attn_hi.permute((1, 0)),
                                  grad_attn_lo.permute((1, 0)), zeros_tile, False,
                                  PRODUCTS)                                # [BN,BM]
        # dV of the previous tile is done reading the registers about to be reused
        p_t_hi, p_t_lo = warpgroup_mma_wait(2 * PRODUCTS, deps=(p_t_hi, p_t_lo))
        p_t = gl.where((queries < SEQ_LEN)[None, :], p_t_next, 0.0)
        p_t_hi, p_t_lo = split_operand(p_t, dtype, PRODUCTS, a_layout, 1.0)
        grad_v = issue_products(p_t_hi, p_t_lo, grad_attn_hi, grad_attn_lo, grad_v, True,
                                PRODUCTS)
        p_t_next = next_p_t_tile(probs_head, key_offsets, queries, m_start, n_start,
                                 SEQ_LEN, BLOCK_M, BLOCK_N, PREFETCH, num_warps)
        # dP^T, and dK of the previous tile with it: that tile's slot is read no more
        grad_p_t, grad_s_t_hi, grad_s_t_lo = warpgroup_mma_wait(
            PRODUCTS, deps=(grad_p_t, grad_s_t_hi, grad_s_t_lo))
        # every consumer thread is past those products; predicated, not branched on: a
        # branch here made ptxas 3.9's serialize every wgmma (C7513)
        cta_barrier()
        mbarrier.arrive(empty.index((m_tile + NUM_STAGES - 1) % NUM_STAGES), count=1,
                        pred=m_tile > 0)
        grad_s_t = p_t * (grad_p_t - delta[None, :])                      # [BN,BM]
        grad_s_t_hi, grad_s_t_lo = split_operand(grad_s_t, dtype, PRODUCTS, a_layout, 1.0)
        grad_k = issue_products(grad_s_t_hi, grad_s_t_lo, q_hi, q_lo, grad_k, True,
                                PRODUCTS)
    grad_k, grad_v, p_t_hi, p_t_lo, grad_s_t_hi, grad_s_t_lo = warpgroup_mma_wait(
        0, deps=(grad_k, grad_v, p_t_hi, p_t_lo, grad_s_t_hi, grad_s_t_lo))

    store_cols_outputs(GRAD_KV16, GRAD_KV_HALVES, GRAD_KV_SUMS, grad_k * scale, grad_v,
                       batch, head, n_start, SEQ_LEN, NUM_HEADS, HEAD_DIM, 1, SUM_ROWS,
                       BLOCK_N, acc_layout)


@gluon.jit
def attention_cols_ws_kernel(PROBS, q_hi_desc, q_lo_desc, grad_attn_hi_desc,
                             grad_attn_lo_desc, v_hi_desc, v_lo_desc, DELTA, GRAD_KV16,
                             GRAD_KV_HALVES, GRAD_KV_SUMS, scale, NUM_HEADS: gl.constexpr,
                             SEQ_LEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             NUM_STAGES: gl.constexpr, PREFETCH: gl.constexpr,
                             SUM_ROWS: gl.constexpr,
                             HEADS_IN_ROWS: gl.constexpr, WORKER_REGISTERS: gl.constexpr,
                             num_warps: gl.constexpr):
    """dK, dV of keys [key block * BLOCK_N, + BLOCK_N) of one (batch, head): program ids
    (key block, batch * NUM_HEADS + head). PROBS: P [B,H,S,S] float32; DELTA [B,H,S]
    float32 (rowsum(P * dP), the rows pass's); the descriptors: TMA descriptors of [BM,D]
    tiles of the bf16 halves (hi, lo) of q and grad_attn and of [BN,D] tiles of v's
    (head_coordinates says where a head lies). Outputs as the two-pass cols kernel's
    with bf16 halves: GRAD_KV16 [B,S,2E] fp16 (dK | dV), GRAD_KV_HALVES [B,S,4E] bf16,
    GRAD_KV_SUMS [B,G,2E] float32. BLOCK_N = 16 * num_warps (one consumer warpgroup per
    64 keys); the producer warp keeps WORKER_REGISTERS registers per thread."""
    gl.static_assert(BLOCK_N == 16 * num_warps, "one consumer warpgroup per 64 keys")
    gl.static_assert(NUM_STAGES >= 2, "a slot is given back only after the next tile's "
                     "products are issued")
    dtype: gl.constexpr = v_hi_desc.dtype
    own = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_hi_desc.layout)
    ring_q = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, BLOCK_M, HEAD_DIM],
                                       q_hi_desc.layout)
    ring_grad_attn = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, BLOCK_M, HEAD_DIM],
                                               grad_attn_hi_desc.layout)
    own_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(own_ready, count=1)
    for stage in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (cols_compute_partition, (PROBS, DELTA, GRAD_KV16, GRAD_KV_HALVES, GRAD_KV_SUMS,
                                  scale, own, ring_q, ring_grad_attn, own_ready, ready,
                                  empty, NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_M, BLOCK_N,
                                  NUM_STAGES, PREFETCH, SUM_ROWS, num_warps)),
        (cols_load_partition, (q_hi_desc, q_lo_desc, grad_attn_hi_desc, grad_attn_lo_desc,
                               v_hi_desc, v_lo_desc, own, ring_q, ring_grad_attn,
                               own_ready, ready, empty, NUM_HEADS, SEQ_LEN, HEAD_DIM,
                               BLOCK_M, BLOCK_N, NUM_STAGES, HEADS_IN_ROWS)),
    ], [1], [WORKER_REGISTERS])
