"""Gluon device code for the two passes of the attention-core backward with P given
(the contract's mode), warp-specialized on Hopper (sm_90): the math and the outputs of
kernels/softmax_bwd_gluon.py's rows and cols kernels with P given and bf16x3 products,
where a producer warp feeds the operand tiles by TMA and the products of both consumer
warpgroups stay in flight. One kernel, its pass chosen by ROWS_PASS.

A program owns 128 rows of one (batch, head) (program ids: row block, batch * NUM_HEADS
+ head, the two-pass kernels' grids): keys in the cols pass, queries in the rows pass.
It walks the tiles of the other side in two partitions:

    producer (one warp, few registers): TMA  the program's own [128,D] tiles, hi and lo,
        once (v in the cols pass, dO in the rows pass); then the pair of tiles of each
        step (q_m and dO_m [BM,D]; k_n and v_n [BN,D]), hi and lo, into a
        NUM_STAGES-deep ring, each slot guarded by a ready and an empty mbarrier; with
        P_BY_PRODUCER four warps, which also copy each step's P tile into a ring of its
        own (load_p_tile), and the consumers read P_m there instead of loading it ahead
    consumers (two warpgroups, 64 of the program's rows each), cols pass, query tile m:
        issue  dP^T = v @ dO_m^T                              [BN,BM]
        wait   for dV of tile m-1 (it reads the P^T registers reused next)
               P^T_m: loaded a tile ahead into the accumulator's registers, zero past
               the sequence's queries
        issue  dV += P^T @ dO_m                               [BN,D]
        load   P^T_{m+1} (registers); the L2 asked for the tiles PREFETCH ahead of it
        wait   for dP^T (dV in flight), and with it dK of tile m-1: give slot m-1 back
        dS^T = P^T * (dP^T - delta_m)
        issue  dK += dS^T @ q_m                               [BN,D]
    at the end dK * scale and dV, stored as the two-pass cols kernel stores them; rows
    pass, key tile n:
        issue  dP = dO @ v_n^T                                [BM,BN]
        wait   for P k of tile n-1 (it reads the P registers reused next)
               P_n: loaded a tile ahead, zero past the sequence's keys
        issue  P k += P_n @ k_n                               [BM,D]
        load   P_{n+1}; the L2 asked for the tiles PREFETCH ahead of it
        wait   for dP (P k in flight), and with it (P*dP) k of tile n-1: give slot n-1
               back
        delta += rowsum(P * dP)
        issue  (P*dP) k += (P * dP) @ k_n                     [BM,D]
    at the end dQ = ((P*dP) k - delta * P k) * scale and delta, stored as the two-pass
    rows kernel stores them.

Three products per matmul (bf16x3 on bf16 halves, small terms first:
softmax_bwd_gluon.issue_products), the contract's precision "high"; the [128,B] tiles
are split in registers into the A operands of the second and third products
(split_operand), so none goes through shared memory. Two waits per tile, each leaving
products in flight. At 64-row tiles of the other side the cols pass spilled 340 bytes
(100 in the walk) of the consumers' 240 registers; 32-row tiles spill nothing in either
pass (tests/test_attention_passes_ws.py).

The operand tiles come by TMA, which has no per-head bound: the rows of a tile past
the sequence end are the next head's (or batch element's) rows, or zeros past the
tensor's end. Where it matters their columns of P are zeroed (queries or keys past the
end add nothing: finite rows, as in kernels/attention_bwd_ws.py, where a NaN or inf in
a neighbour's first rows would reach through a zero of P), and the program's own rows
past the end are never stored (left out of the stores, delta and the column sums). P's
rows (577 floats) are 4-byte aligned only, and a TMA box's innermost coordinate must be
a multiple of 16 bytes (a box from column 1 of a float32 tensor raised "illegal
instruction" on an H100, docs/performance.md), so P comes by one of two routes, both
from clamped indices (softmax_bwd_gluon.clamped): loaded by the consumers into
registers a tile ahead, as in the two-pass kernels; or, with P_BY_PRODUCER, copied by
the producer partition (four warps: the warpgroup the producer warp pads out) with
4-byte cp.async into a ring of [own, walked] tiles beside the operands' (load_p_tile),
which the consumers read from shared memory when its mbarrier completes.

tests/test_attention_passes_ws.py checks its machine code for sm_90 on the CPU;
scripts/time_core_passes_ws.py checks it against float64 and the two-pass kernels and
times it: on the H200 right, bitwise the two-pass kernels' gradients by either route
for P, and slower than them (attention_bwd_ws.py says by how much), so not an autotune
choice.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma_wait)

from .attention_bwd_ws import head_coordinates
from .gluon_compat import async_load, cta_barrier, tma_load
from .softmax_bwd_gluon import (clamped, cols_carried_values, issue_products, load_vector,
                                next_p_t_tile, next_p_tile, prefetch_to_l2, split_operand,
                                store_cols_outputs, store_rows_outputs, tile_parts,
                                wgmma_layout)

# the producer partition's warps where it also loads P (P_BY_PRODUCER); the one TMA warp
# otherwise (padded to a warpgroup either way: the launch's registers are the same)
P_LOADER_WARPS = gl.constexpr(4)


@gluon.jit
def load_partition(PROBS, own_hi_desc, own_lo_desc, a_hi_desc, a_lo_desc, b_hi_desc,
                   b_lo_desc, own, ring_a, ring_b, ring_p, own_ready, ready, p_ready, empty,
                   NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                   OWN_ROWS: gl.constexpr, TILE_ROWS: gl.constexpr,
                   NUM_STAGES: gl.constexpr, HEADS_IN_ROWS: gl.constexpr,
                   ROWS_PASS: gl.constexpr, P_BY_PRODUCER: gl.constexpr):
    """The producer: the program's own tiles (v; dO in the rows pass), then each step's
    two tiles (a: q, b: dO; rows pass a: k, b: v) through the ring, in order; with
    P_BY_PRODUCER also each step's P tile (load_p_tile)."""
    NUM_TILES: gl.constexpr = (SEQ_LEN + TILE_ROWS - 1) // TILE_ROWS
    batch_head = gl.program_id(1)
    own_start = gl.program_id(0) * OWN_ROWS
    qkv_row, qkv_col = head_coordinates(batch_head, NUM_HEADS, SEQ_LEN, HEAD_DIM,
                                        HEADS_IN_ROWS)
    do_row, do_col = head_coordinates(batch_head, NUM_HEADS, SEQ_LEN, HEAD_DIM, False)
    if ROWS_PASS:                      # own: dO; a, b: k, v
        own_row, own_col, b_row, b_col = do_row, do_col, qkv_row, qkv_col
    else:                              # own: v; a, b: q, dO
        own_row, own_col, b_row, b_col = qkv_row, qkv_col, do_row, do_col
    mbarrier.expect(own_ready, 2 * own_hi_desc.block_type.nbytes)
    tma_load(own_hi_desc, [own_row + own_start, own_col], own_ready, own.index(0))
    tma_load(own_lo_desc, [own_row + own_start, own_col], own_ready, own.index(1))
    for tile in range(NUM_TILES):
        slot = tile % NUM_STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0
        mbarrier.wait(empty.index(slot), ((tile // NUM_STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * (a_hi_desc.block_type.nbytes + b_hi_desc.block_type.nbytes))
        a_hi, a_lo = tile_parts(ring_a, slot, 2)
        b_hi, b_lo = tile_parts(ring_b, slot, 2)
        tma_load(a_hi_desc, [qkv_row + tile * TILE_ROWS, qkv_col], bar, a_hi)
        tma_load(a_lo_desc, [qkv_row + tile * TILE_ROWS, qkv_col], bar, a_lo)
        tma_load(b_hi_desc, [b_row + tile * TILE_ROWS, b_col], bar, b_hi)
        tma_load(b_lo_desc, [b_row + tile * TILE_ROWS, b_col], bar, b_lo)
        if P_BY_PRODUCER:
            load_p_tile(PROBS, batch_head, own_start, tile * TILE_ROWS, ring_p.index(slot),
                        p_ready.index(slot), SEQ_LEN, OWN_ROWS, TILE_ROWS, ROWS_PASS)


@gluon.jit
def p_offsets(owned, walked, SEQ_LEN: gl.constexpr, ROWS_PASS: gl.constexpr):
    """Where a step's P tile [own, walked] lies in one head's P [S,S], from clamped
    indices (softmax_bwd_gluon.clamped): the owned rows' offsets as a column and the
    walked rows' as a row, to be added. Element (query, key) lies at query * SEQ_LEN +
    key, so the rows pass's own rows are P's rows and the cols pass's are its columns.
    The consumers' next tiles (softmax_bwd_gluon.next_p_tile, next_p_t_tile, shared with
    the two-pass kernels) take the owned offsets from here."""
    if ROWS_PASS:
        return (clamped(owned, SEQ_LEN) * SEQ_LEN)[:, None], clamped(walked, SEQ_LEN)[None, :]
    return clamped(owned, SEQ_LEN)[:, None], (clamped(walked, SEQ_LEN) * SEQ_LEN)[None, :]


@gluon.jit
def load_p_tile(PROBS, batch_head, own_start, tile_start, p_slot, p_ready,
                SEQ_LEN: gl.constexpr, OWN_ROWS: gl.constexpr, TILE_ROWS: gl.constexpr,
                ROWS_PASS: gl.constexpr):
    """cp.async copies of a step's P tile [own, walked] (rows pass: P[own queries,
    walked keys]; cols pass: P^T[own keys, walked queries]) into p_slot, by every thread
    of the producer partition, 4 bytes each (module docstring: no TMA for P). In chunks
    of 32 own rows, so that a thread holds 8 addresses at a time (the rows pass's
    addresses of all 128 rows at once spilled the producer's 40 registers); a warp's
    copy reads 4 rows of 8 keys in the rows pass, 32 keys of one query in the cols pass
    (each row's 32 bytes may straddle two sectors: P's rows start 4-byte aligned).
    p_ready (count: the partition's threads) completes when every thread's copies have
    landed."""
    CHUNK: gl.constexpr = 32
    if ROWS_PASS:                      # along the walked keys, contiguous in P
        layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [P_LOADER_WARPS, 1],
                                                [1, 0])
    else:                              # along the own keys, contiguous in P^T's columns
        layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, P_LOADER_WARPS],
                                                [0, 1])
    probs_head = PROBS + batch_head.to(gl.int64) * SEQ_LEN * SEQ_LEN
    walked = tile_start + gl.arange(0, TILE_ROWS, layout=gl.SliceLayout(0, layout))
    for chunk in gl.static_range(OWN_ROWS // CHUNK):
        owned = own_start + chunk * CHUNK + gl.arange(0, CHUNK,
                                                      layout=gl.SliceLayout(1, layout))
        own_offsets, walked_offsets = p_offsets(owned, walked, SEQ_LEN, ROWS_PASS)
        async_load(p_slot.slice(chunk * CHUNK, CHUNK, dim=0),
                   probs_head + own_offsets + walked_offsets)
    async_copy.mbarrier_arrive(p_ready, increment_count=False)


@gluon.jit
def compute_partition(PROBS, DELTA, GRAD16, GRAD_HALVES, GRAD_SUMS, scale, own, ring_a,
                      ring_b, ring_p, own_ready, ready, p_ready, empty,
                      NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_STAGES: gl.constexpr, PREFETCH: gl.constexpr,
                      SUM_ROWS: gl.constexpr, ROWS_PASS: gl.constexpr,
                      P_BY_PRODUCER: gl.constexpr, num_warps: gl.constexpr):
    """The consumers of either pass: three products per step (module docstring) with
    the [own, walked] tiles in registers: X = own @ b^T (dP^T = v dO^T; rows pass dP =
    dO v^T), the second product's accumulator += P' @ (b; rows pass a) (dV; P k), the
    third's += S' @ a (dK with S' = P^T * (dP^T - delta); (P*dP) k with S' = P * dP);
    then the pass's outputs stored."""
    OWN_ROWS: gl.constexpr = BLOCK_M if ROWS_PASS else BLOCK_N
    TILE_ROWS: gl.constexpr = BLOCK_N if ROWS_PASS else BLOCK_M
    NUM_TILES: gl.constexpr = (SEQ_LEN + TILE_ROWS - 1) // TILE_ROWS
    PRODUCTS: gl.constexpr = 3
    dtype: gl.constexpr = own.dtype                                       # bf16
    tile_layout: gl.constexpr = wgmma_layout(num_warps, TILE_ROWS)    # [own, walked]
    acc_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DIM)      # [own, D]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                 k_width=2)
    own_vector: gl.constexpr = gl.SliceLayout(1, tile_layout)
    walked_vector: gl.constexpr = gl.SliceLayout(0, tile_layout)

    batch_head = gl.program_id(1)
    batch = batch_head // NUM_HEADS
    head = batch_head % NUM_HEADS
    own_start = gl.program_id(0) * OWN_ROWS
    owned = own_start + gl.arange(0, OWN_ROWS, layout=own_vector)
    delta_head = DELTA + batch_head.to(gl.int64) * SEQ_LEN
    tile_walked = gl.arange(0, TILE_ROWS, layout=walked_vector)
    if ROWS_PASS:
        delta = gl.zeros([OWN_ROWS], gl.float32, layout=own_vector)      # summed below
    if not P_BY_PRODUCER:              # the first P tile, and the L2 asked for the next
        probs_head = PROBS + batch_head.to(gl.int64) * SEQ_LEN * SEQ_LEN
        own_offsets, walked_offsets = p_offsets(owned, tile_walked, SEQ_LEN, ROWS_PASS)
        p_next = gl.load(probs_head + own_offsets + walked_offsets)
        for ahead in gl.static_range(1, PREFETCH + 1):
            if ROWS_PASS:
                prefetch_to_l2(probs_head, own_start, ahead * TILE_ROWS, SEQ_LEN, BLOCK_M,
                               BLOCK_N, num_warps)
            else:
                prefetch_to_l2(probs_head, ahead * TILE_ROWS, own_start, SEQ_LEN, BLOCK_M,
                               BLOCK_N, num_warps)
    zeros_tile = gl.zeros([OWN_ROWS, TILE_ROWS], gl.float32, layout=tile_layout)
    # the second and third products' accumulators, and the register operands in flight
    second, third, p_hi, p_lo, s_hi, s_lo = cols_carried_values(
        OWN_ROWS, TILE_ROWS, HEAD_DIM, dtype, acc_layout, a_layout)
    mbarrier.wait(own_ready, 0)
    own_hi, own_lo = tile_parts(own, 0, 2)                      # v; rows pass dO
    for tile in range(NUM_TILES):
        slot = tile % NUM_STAGES
        tile_start = tile * TILE_ROWS
        walked = tile_start + tile_walked
        if not ROWS_PASS:
            delta = load_vector(delta_head, tile_start, SEQ_LEN, TILE_ROWS, walked_vector)
        mbarrier.wait(ready.index(slot), (tile // NUM_STAGES) & 1)
        a_hi, a_lo = tile_parts(ring_a, slot, 2)                # q; rows pass k
        b_hi, b_lo = tile_parts(ring_b, slot, 2)                # dO; rows pass v
        x = issue_products(own_hi, own_lo, b_hi.permute((1, 0)), b_lo.permute((1, 0)),
                           zeros_tile, False, PRODUCTS)          # dP^T; rows pass dP
        # the previous step's second product is done reading the registers reused next
        p_hi, p_lo = warpgroup_mma_wait(2 * PRODUCTS, deps=(p_hi, p_lo))
        if P_BY_PRODUCER:              # this step's tile, from the producer's ring
            mbarrier.wait(p_ready.index(slot), (tile // NUM_STAGES) & 1)
            p = ring_p.index(slot).load(tile_layout)
        else:                          # loaded a step ahead
            p = p_next
        p = gl.where((walked < SEQ_LEN)[None, :], p, 0.0)
        p_hi, p_lo = split_operand(p, dtype, PRODUCTS, a_layout, 1.0)
        if ROWS_PASS:
            second = issue_products(p_hi, p_lo, a_hi, a_lo, second, True, PRODUCTS)
        else:
            second = issue_products(p_hi, p_lo, b_hi, b_lo, second, True, PRODUCTS)
        if not P_BY_PRODUCER:
            if ROWS_PASS:
                p_next = next_p_tile(probs_head, own_offsets, walked, own_start, tile_start,
                                     SEQ_LEN, BLOCK_M, BLOCK_N, PREFETCH, num_warps)
            else:
                p_next = next_p_t_tile(probs_head, own_offsets, walked, tile_start,
                                       own_start, SEQ_LEN, BLOCK_M, BLOCK_N, PREFETCH,
                                       num_warps)
        # X, and the previous step's third product with it: its slot is read no more
        x, s_hi, s_lo = warpgroup_mma_wait(PRODUCTS, deps=(x, s_hi, s_lo))
        # every consumer thread is past those products; predicated, not branched on: a
        # branch here made ptxas 3.9's serialize every wgmma (C7513)
        cta_barrier()
        mbarrier.arrive(empty.index((tile + NUM_STAGES - 1) % NUM_STAGES), count=1,
                        pred=tile > 0)
        if ROWS_PASS:
            s = p * x                                            # P * dP
            delta += gl.sum(s, axis=1)
        else:
            s = p * (x - delta[None, :])                         # dS^T
        s_hi, s_lo = split_operand(s, dtype, PRODUCTS, a_layout, 1.0)
        third = issue_products(s_hi, s_lo, a_hi, a_lo, third, True, PRODUCTS)
    second, third, p_hi, p_lo, s_hi, s_lo = warpgroup_mma_wait(
        0, deps=(second, third, p_hi, p_lo, s_hi, s_lo))

    if ROWS_PASS:                      # second: P k, third: (P*dP) k
        delta_acc = gl.convert_layout(delta, gl.SliceLayout(1, acc_layout))
        store_rows_outputs(DELTA, GRAD16, GRAD_HALVES, GRAD_SUMS,
                           (third - delta_acc[:, None] * second) * scale, delta,
                           batch_head.to(gl.int64), batch, head, own_start, SEQ_LEN,
                           NUM_HEADS, HEAD_DIM, 1, SUM_ROWS, BLOCK_M, own_vector, acc_layout)
    else:                              # second: dV, third: dK / scale
        store_cols_outputs(GRAD16, GRAD_HALVES, GRAD_SUMS, third * scale, second, batch,
                           head, own_start, SEQ_LEN, NUM_HEADS, HEAD_DIM, 1, SUM_ROWS,
                           BLOCK_N, acc_layout)


@gluon.jit
def attention_passes_ws_kernel(PROBS, own_hi_desc, own_lo_desc, a_hi_desc, a_lo_desc,
                               b_hi_desc, b_lo_desc, DELTA, GRAD16, GRAD_HALVES, GRAD_SUMS,
                               scale, NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                               PREFETCH: gl.constexpr, SUM_ROWS: gl.constexpr,
                               HEADS_IN_ROWS: gl.constexpr, ROWS_PASS: gl.constexpr,
                               P_BY_PRODUCER: gl.constexpr, WORKER_REGISTERS: gl.constexpr,
                               num_warps: gl.constexpr):
    """One pass with P given, of the 128 rows a program owns of one (batch, head):
    program ids (row block, batch * NUM_HEADS + head). PROBS: P [B,H,S,S] float32. The
    descriptors: TMA descriptors of the bf16 halves (hi, lo) of
      cols pass (BLOCK_N = 128 keys own): own v [BN,D], a q [BM,D], b grad_attn [BM,D];
        DELTA [B,H,S] float32 read (rowsum(P * dP), the rows pass's); outputs GRAD16
        [B,S,2E] fp16 (dK | dV), GRAD_HALVES [B,S,4E] bf16, GRAD_SUMS [B,G,2E] float32;
      rows pass (ROWS_PASS, BLOCK_M = 128 queries own): own grad_attn [BM,D], a k [BN,D],
        b v [BN,D]; outputs DELTA [B,H,S] float32, GRAD16 [B,S,E] fp16 (dQ), GRAD_HALVES
        [B,S,2E] bf16, GRAD_SUMS [B,G,E] float32;
    as the two-pass kernels' (head_coordinates says where a head lies in q, k, v and
    grad_attn). The owned rows are 16 * num_warps (one consumer warpgroup per 64); the
    producer partition (one warp; four with P_BY_PRODUCER, which then copies P's tiles)
    keeps WORKER_REGISTERS registers per thread."""
    OWN_ROWS: gl.constexpr = BLOCK_M if ROWS_PASS else BLOCK_N
    TILE_ROWS: gl.constexpr = BLOCK_N if ROWS_PASS else BLOCK_M
    gl.static_assert(OWN_ROWS == 16 * num_warps, "one consumer warpgroup per 64 rows")
    gl.static_assert(NUM_STAGES >= 2, "a slot is given back only after the next tile's "
                     "products are issued")
    dtype: gl.constexpr = own_hi_desc.dtype
    own = gl.allocate_shared_memory(dtype, [2, OWN_ROWS, HEAD_DIM], own_hi_desc.layout)
    ring_a = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, TILE_ROWS, HEAD_DIM],
                                       a_hi_desc.layout)
    ring_b = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, TILE_ROWS, HEAD_DIM],
                                       b_hi_desc.layout)
    own_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    if P_BY_PRODUCER:                  # [own, walked] P tiles, read in the tile layout
        ring_p = gl.allocate_shared_memory(
            gl.float32, [NUM_STAGES, OWN_ROWS, TILE_ROWS],
            gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0]))
        p_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1],
                                            mbarrier.MBarrierLayout())
    else:                              # placeholders: one argument list for both routes
        ring_p, p_ready = own, ready
    mbarrier.init(own_ready, count=1)
    for stage in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=1)
        if P_BY_PRODUCER:
            mbarrier.init(p_ready.index(stage), count=32 * P_LOADER_WARPS)
    fence_async_shared()

    gl.warp_specialize([
        (compute_partition, (PROBS, DELTA, GRAD16, GRAD_HALVES, GRAD_SUMS, scale, own,
                             ring_a, ring_b, ring_p, own_ready, ready, p_ready, empty,
                             NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                             PREFETCH, SUM_ROWS, ROWS_PASS, P_BY_PRODUCER, num_warps)),
        (load_partition, (PROBS, own_hi_desc, own_lo_desc, a_hi_desc, a_lo_desc, b_hi_desc,
                          b_lo_desc, own, ring_a, ring_b, ring_p, own_ready, ready, p_ready,
                          empty, NUM_HEADS, SEQ_LEN, HEAD_DIM, OWN_ROWS, TILE_ROWS,
                          NUM_STAGES, HEADS_IN_ROWS, ROWS_PASS, P_BY_PRODUCER)),
    ], [P_LOADER_WARPS if P_BY_PRODUCER else 1], [WORKER_REGISTERS])
