"""Gluon device code for the whole attention-core backward in one warp-specialized pass on
Hopper (sm_90): one product per matmul of bf16 / fp16 operands, P recomputed from the
forward's log-sum-exp (attention_bwd_ws_kernel), and the pass before it that computes
delta = rowsum(dO * O), scales the log-sum-exp to base 2 and zeroes the semaphores
(attention_delta_kernel).

A work item is BLOCK_N = 128 keys of one (batch, head); a program walks every query tile
(BLOCK_M = 128 queries) of its items in three partitions: a producer warp loading k, v
and a ring of q, dO tiles by TMA; two consumer warpgroups issuing the five products per
tile (S, dP, dV, dQ, dK) with three waits; and a dQ-writer warp that adds each dQ tile
into the head's dQ in a fixed order of turns, so the result is bitwise reproducible. The
partitions, the register budget, the rotated walk and why every wait ends: the comment
below.
"""
# A work item is BLOCK_N = 128 keys of one (batch, head); a program walks every query tile
# (BLOCK_M = 128 queries) of an item, and takes items p, p + P, p + 2P, ... of its grid's
# P programs (one item each in a grid of one program per item), in three partitions:
#
#     producer (one warp, few registers), per item:
#         TMA  k, v [BN,D] into shared memory (once the consumers are done with the item
#              before); then q_m, dO_m [BM,D] into a NUM_STAGES-deep ring, each slot
#              guarded by a ready and an empty mbarrier
#     consumers (two warpgroups, one per 64 queries, the registers the workers gave up),
#     tile m:
#         issue  S_m  = q_m @ k^T,  dP_m = dO_m @ v^T          [BM,BN]
#         wait   for S_m (dK of tile m-1 done too: give slot m-1 back to the producer)
#                P = exp(S * scale - lse)  (0 for rows / columns past S), into shared
#                memory
#         issue  dV  += P^T @ dO_m                              [BN,D]
#         wait   for dP_m: dS = P * (dP - delta), into shared memory
#         issue  dQ_m = dS @ k,  dK += dS^T @ q_m               [BM,D], [BN,D]
#         wait   for dQ_m (dK in flight): hand it to the dQ writer in shared memory
#                (or, with DEFERRED_GRAD_Q, store it there and hand it over at tile
#                m+1's first barrier)
#     at the item's end: dK, dV through the P tile in shared memory to GRAD_QKV
#     dQ writer (one warp): adds each dQ_m into the head's dQ (below)
#
# Five products per tile, the minimum (two passes recompute S and dP twice: seven), with
# three waits per tile, each leaving a product in flight. S and dP stay in the consumers'
# registers with queries in rows (224 accumulator registers a thread with dQ, dK and dV;
# they get 240), and P and dS reach the products as shared-memory operands: with keys in
# rows (S^T, dP^T in registers as the A operands of dV and dK) the same tiles would need
# ~290 registers. dQ is issued and waited in its own tile: carried into the next, its
# accumulator made ptxas serialize the wgmmas for want of registers.
#
# With ROTATED_WALK (a persistent grid; as many key blocks as query tiles) key block b
# walks the query tiles from tile b on, wrapping around, so that at every step the blocks
# of a head work on different tiles: in key-block order they reach a tile at the same
# step, and each waits for the adds of the blocks before it (measured at batch 32: 0.566 ms in
# order, 0.440 rotated).
#
# dQ is deterministic: the key blocks of a head add their dQ_m tiles in a fixed order of
# turns (the key-block order; with ROTATED_WALK the order of arrival, a block's step),
# enforced by one int32 semaphore per (head, query tile) that counts the turns already
# taken (SEMAPHORES, cleared by attention_delta_kernel). The first turn stores its tile
# into a float32 sum with a TMA copy, the others wait for their turn and add theirs with
# a TMA add (cp.reduce.async.bulk.tensor, one block at a time), each giving its buffer
# back once the copy has read it and counting itself on the semaphore once the copy is
# performed in global memory; the last turn then loads the sum back by TMA and stores dQ,
# scaled, in the operands' dtype: the sum's order is fixed, so the result is bitwise
# reproducible. A head's key blocks are consecutive items. In key-block order a block
# waits only on lower items, which their programs take before any higher one: every wait
# ends provided all programs run at once (a grid of one program per item launches in
# item order; a persistent grid is a cooperative launch). The rotated walk makes a block
# wait on any block of its head, so it runs on a persistent grid of at least as many
# programs as a head has blocks: a head's blocks then run on different programs, and a
# head whose items wrap from the last program to the first waits only on items the first
# programs take next, after items whose own waits end by the same argument one round
# earlier. Rows past the sequence end: TMA reads the next rows of the tensor (zeros past
# its end); P and dS are 0 there, so their dQ rows are 0 (added into the sum's padding
# rows) and nothing is stored for them in the outputs.
#
# delta = rowsum(dO * O) [B,H,S] float32 comes from attention_delta_kernel, a pass over dO
# and O before the main kernel, which scales the log-sum-exp to base 2 and zeroes the
# semaphores too.

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              tma, warpgroup_mma,
                                                              warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from .gluon_compat import cta_barrier, tma_add, tma_load, tma_store
from .softmax_bwd_gluon import LOG2E, wgmma_layout


@gluon.jit
def head_coordinates(batch_head, NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
                     HEAD_DIM: gl.constexpr, HEADS_IN_ROWS: gl.constexpr):
    """(first row, column) of one (batch, head) in the 2-D TMA view of q, k, v: rows of
    [B*H*S, D] when HEADS_IN_ROWS (contiguous [B,H,S,D]), else of [B*S, E] (head views
    of the QKV projection, or dO [B,S,E])."""
    if HEADS_IN_ROWS:
        return batch_head * SEQ_LEN, 0
    return (batch_head // NUM_HEADS) * SEQ_LEN, (batch_head % NUM_HEADS) * HEAD_DIM


@gluon.jit
def work_item(item, SEQ_LEN: gl.constexpr, BLOCK_N: gl.constexpr):
    """(key block, batch * NUM_HEADS + head, this program's count of earlier items) of
    work item `item`: the key blocks of a head are consecutive items, and program p
    takes items p, p + P, p + 2P, ... of the P programs (one item each when the grid
    has one program per item)."""
    NUM_BLOCKS: gl.constexpr = (SEQ_LEN + BLOCK_N - 1) // BLOCK_N
    return (item % NUM_BLOCKS, item // NUM_BLOCKS,
            (item - gl.program_id(0)) // gl.num_programs(0))


@gluon.jit
def walk_tile(step, block, NUM_TILES: gl.constexpr, ROTATED_WALK: gl.constexpr):
    """The query tile that key block `block` takes at `step` of its walk: tile `step`,
    or with ROTATED_WALK tile (step + block) % NUM_TILES, so that at every step the
    key blocks of a head (as many as query tiles) each take a different tile."""
    if ROTATED_WALK:
        return (step + block) % NUM_TILES
    return step


@gluon.jit
def load_partition(q_desc, k_desc, v_desc, grad_attn_desc, k_tile, v_tile, q_ring,
                   grad_attn_ring, kv_ready, kv_empty, ready, empty, num_items,
                   NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                   HEADS_IN_ROWS: gl.constexpr, ROTATED_WALK: gl.constexpr):
    """The producer: for each work item its k, v tiles (once the consumers are done with
    the item before), then every query tile's q and dO through the ring, in the order
    of the item's walk."""
    NUM_TILES: gl.constexpr = (SEQ_LEN + BLOCK_M - 1) // BLOCK_M
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        block, batch_head, earlier = work_item(item, SEQ_LEN, BLOCK_N)
        qkv_row, qkv_col = head_coordinates(batch_head, NUM_HEADS, SEQ_LEN, HEAD_DIM,
                                            HEADS_IN_ROWS)
        do_row, do_col = head_coordinates(batch_head, NUM_HEADS, SEQ_LEN, HEAD_DIM, False)
        # a fresh mbarrier counts as having completed the phase before phase 0
        mbarrier.wait(kv_empty, (earlier & 1) ^ 1)
        mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, [qkv_row + block * BLOCK_N, qkv_col], kv_ready, k_tile)
        tma_load(v_desc, [qkv_row + block * BLOCK_N, qkv_col], kv_ready, v_tile)
        for step in range(NUM_TILES):
            m_tile = walk_tile(step, block, NUM_TILES, ROTATED_WALK)
            tile_count = earlier * NUM_TILES + step        # this program's tiles so far
            slot = tile_count % NUM_STAGES
            mbarrier.wait(empty.index(slot), ((tile_count // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, q_desc.block_type.nbytes
                            + grad_attn_desc.block_type.nbytes)
            tma_load(q_desc, [qkv_row + m_tile * BLOCK_M, qkv_col], bar, q_ring.index(slot))
            tma_load(grad_attn_desc, [do_row + m_tile * BLOCK_M, do_col], bar,
                     grad_attn_ring.index(slot))


@gluon.jit
def bulk_writes_done():
    """Wait until this thread's TMA stores and adds are performed in global memory, then
    order them before its later global accesses of any proxy (cp.async.bulk.wait_group
    0 and fence.proxy.async.global; tma.store_wait waits only until the copies have
    read shared memory, unless given read_only=False, which triton 3.6 and 3.7 lack)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\nfence.proxy.async.global;"
                              "\nmov.b32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def async_proxy_fence():
    """Order this thread's earlier global accesses (the semaphore's acquire) before its
    later TMA copies (fence.proxy.async.global)."""
    gl.inline_asm_elementwise("fence.proxy.async.global;\nmov.b32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def store_grad_q(grad_q_tile, batch_head, m_tile, GRAD_QKV, scale, NUM_HEADS: gl.constexpr,
                 SEQ_LEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """dQ * scale of query tile m_tile, from its float32 sum [BM,D] in shared memory,
    into GRAD_QKV [B,S,3E]'s dQ columns (the rows before the sequence end), 8 rows a
    step (a 128-byte swizzle's period: a tile is sliced no finer), eight columns per
    lane: one 16-byte store each."""
    CHUNK_ROWS: gl.constexpr = 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8],
                                            [1, 1], [1, 0])
    batch = batch_head // NUM_HEADS
    head = batch_head % NUM_HEADS
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    chunk_rows = gl.arange(0, CHUNK_ROWS, layout=gl.SliceLayout(1, layout))
    for chunk in gl.static_range(BLOCK_M // CHUNK_ROWS):
        part = grad_q_tile.slice(chunk * CHUNK_ROWS, CHUNK_ROWS).load(layout)
        rows = m_tile * BLOCK_M + chunk * CHUNK_ROWS + chunk_rows
        out = (GRAD_QKV + ((batch * SEQ_LEN + rows).to(gl.int64) * 3 * NUM_HEADS
                           * HEAD_DIM)[:, None] + head * HEAD_DIM + cols[None, :])
        gl.store(out, (part * scale).to(GRAD_QKV.dtype.element_ty),
                 mask=(rows < SEQ_LEN)[:, None] & (cols < HEAD_DIM)[None, :])


@gluon.jit
def grad_q_partition(grad_q_ring, grad_q_full, grad_q_empty, sum_ready,
                     grad_q_sum_desc, SEMAPHORES, GRAD_QKV, scale, num_items,
                     NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     GRAD_Q_BUFFERS: gl.constexpr, ROTATED_WALK: gl.constexpr):
    """The dQ writer (one warp): takes each query tile's dQ [BM,D] from shared memory and
    adds it to the head's dQ in its fixed order of turns (module docstring) by TMA,
    giving the buffer back as soon as the copy has read it; the last turn loads the sum
    by TMA into the same buffer and stores dQ * scale into GRAD_QKV [B,S,3E]'s dQ
    columns."""
    NUM_TILES: gl.constexpr = (SEQ_LEN + BLOCK_M - 1) // BLOCK_M
    last: gl.constexpr = (SEQ_LEN + BLOCK_N - 1) // BLOCK_N - 1
    sums_loaded = 0                    # this program's loads of a sum (sum_ready's phase)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        block, batch_head, earlier = work_item(item, SEQ_LEN, BLOCK_N)
        for step in range(NUM_TILES):
            m_tile = walk_tile(step, block, NUM_TILES, ROTATED_WALK)
            # this block's turn among the head's blocks adding into tile m_tile: the
            # block index, or with ROTATED_WALK the step (that of its arrival)
            turn = step if ROTATED_WALK else block
            tile_count = earlier * NUM_TILES + step
            buffer = tile_count % GRAD_Q_BUFFERS
            mbarrier.wait(grad_q_full.index(buffer), (tile_count // GRAD_Q_BUFFERS) & 1)
            grad_q_tile = grad_q_ring.index(buffer)                         # [BM,D]
            semaphore = SEMAPHORES + batch_head * NUM_TILES + m_tile
            sum_row = (batch_head * NUM_TILES + m_tile) * BLOCK_M
            if turn > 0:               # wait for the turns before this one
                added = gl.atomic_add(semaphore, 0, sem="acquire", scope="gpu")
                while added != turn:
                    added = gl.atomic_add(semaphore, 0, sem="acquire", scope="gpu")
                async_proxy_fence()
            if last == 0:              # one key block: its tile is dQ
                store_grad_q(grad_q_tile, batch_head, m_tile, GRAD_QKV, scale, NUM_HEADS,
                             SEQ_LEN, HEAD_DIM, BLOCK_M)
                mbarrier.arrive(grad_q_empty.index(buffer), count=1)
            else:
                if turn == 0:
                    tma_store(grad_q_sum_desc, [sum_row, 0], grad_q_tile)
                else:
                    tma_add(grad_q_sum_desc, [sum_row, 0], grad_q_tile)
                if turn == last:       # the sum of every block, back by TMA
                    bulk_writes_done()     # the add is performed in global memory
                    cta_barrier()          # for every lane, before the load
                    mbarrier.expect(sum_ready, grad_q_sum_desc.block_type.nbytes)
                    tma_load(grad_q_sum_desc, [sum_row, 0], sum_ready, grad_q_tile)
                    mbarrier.wait(sum_ready, sums_loaded & 1)
                    sums_loaded += 1
                    store_grad_q(grad_q_tile, batch_head, m_tile, GRAD_QKV, scale,
                                 NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_M)
                    cta_barrier()          # every lane has read the sum
                    mbarrier.arrive(grad_q_empty.index(buffer), count=1)
                else:
                    tma.store_wait(0)      # the copy has read grad_q_tile:
                    cta_barrier()          # the consumers may refill it
                    mbarrier.arrive(grad_q_empty.index(buffer), count=1)
                    bulk_writes_done()     # the copy is performed in global memory
                    cta_barrier()          # (the issuing thread's), before it counts
                    gl.atomic_add(semaphore, 1, sem="release", scope="gpu")


@gluon.jit
def stage_grad_q(grad_q, tile_count, grad_q_ring, grad_q_empty,
                 GRAD_Q_BUFFERS: gl.constexpr):
    """Store the finished dQ tile of this program's tile_count-th query tile into the
    writer's next buffer (of GRAD_Q_BUFFERS), once the writer is done with it. The
    caller hands it over: fence_async_shared (visible to the writer's TMA copy),
    cta_barrier (every consumer thread's part stored), then an arrive on grad_q_full,
    at once or, with DEFERRED_GRAD_Q, in release_slot."""
    buffer = tile_count % GRAD_Q_BUFFERS
    mbarrier.wait(grad_q_empty.index(buffer), ((tile_count // GRAD_Q_BUFFERS) & 1) ^ 1)
    grad_q_ring.index(buffer).store(grad_q)


@gluon.jit
def release_slot(tile_count, empty, grad_q_full, NUM_STAGES: gl.constexpr,
                 GRAD_Q_BUFFERS: gl.constexpr, DEFERRED_GRAD_Q: gl.constexpr):
    """Give the ring slot of this program's tile_count-th query tile back to the
    producer once every consumer thread is past the products that read it (the caller
    waited for them); with DEFERRED_GRAD_Q, at the same barrier hand that tile's dQ
    (stored by stage_grad_q) to the writer, fenced for its TMA copy."""
    if DEFERRED_GRAD_Q:
        fence_async_shared()
    cta_barrier()
    mbarrier.arrive(empty.index(tile_count % NUM_STAGES), count=1)
    if DEFERRED_GRAD_Q:
        mbarrier.arrive(grad_q_full.index(tile_count % GRAD_Q_BUFFERS), count=1)


@gluon.jit
def store_grad_kv(grad_k, grad_v, staging, block, batch_head, GRAD_QKV, scale,
                  NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """dK * scale and dV [BN,D] of key block `block` into GRAD_QKV [B,S,3E] (dK at
    column E + head * D, dV at 2E + head * D; the rows before the sequence end),
    through the two column halves of `staging` [BN,2D] (the P tile, free once the
    item's last dV is done): from the accumulators' layout, a thread's stores would be
    4 bytes each, 2 columns of a row; read back from shared memory they are 16 bytes,
    8 columns (measured: 6% of the kernel's time at batch 32)."""
    EMBED: gl.constexpr = NUM_HEADS * HEAD_DIM
    grad_k_tile = staging.slice(0, HEAD_DIM, dim=1)                    # [BN,D]
    grad_v_tile = staging.slice(HEAD_DIM, HEAD_DIM, dim=1)             # [BN,D]
    grad_k_tile.store((grad_k * scale).to(staging.dtype))
    grad_v_tile.store(grad_v.to(staging.dtype))
    cta_barrier()
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8],
                                            [num_warps, 1], [1, 0])
    rows = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    batch = batch_head // NUM_HEADS
    head = batch_head % NUM_HEADS
    out = (GRAD_QKV + (batch * SEQ_LEN + rows).to(gl.int64)[:, None] * 3 * EMBED
           + EMBED + head * HEAD_DIM + cols[None, :])
    in_rows = (rows < SEQ_LEN)[:, None]
    gl.store(out, grad_k_tile.load(layout), mask=in_rows)
    gl.store(out + EMBED, grad_v_tile.load(layout), mask=in_rows)
    cta_barrier()                      # read before the next item's P is stored


@gluon.jit
def compute_partition(
        k_tile, v_tile, q_ring, grad_attn_ring, probs_tile, grad_s_tile, grad_q_ring,
        kv_ready, kv_empty, ready, empty, grad_q_full, grad_q_empty, LSE_LOG2, DELTA,
        GRAD_QKV, scale, num_items, NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, GRAD_Q_BUFFERS: gl.constexpr,
        ROTATED_WALK: gl.constexpr, DEFERRED_GRAD_Q: gl.constexpr, num_warps: gl.constexpr):
    """The consumers: for each work item, the five products per query tile (module
    docstring) with S and dP [BM,BN] in registers and P and dS [BM,BN] through shared
    memory (the A operands of dV += P^T @ dO, dK += dS^T @ q and dQ = dS @ k), dQ handed
    to the writer, then dK and dV into GRAD_QKV [B,S,3E]."""
    NUM_TILES: gl.constexpr = (SEQ_LEN + BLOCK_M - 1) // BLOCK_M
    dtype: gl.constexpr = k_tile.dtype
    tile_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N)      # [BM,BN]: S, dP
    acc_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DIM)      # dK, dV, dQ
    query_vector: gl.constexpr = gl.SliceLayout(1, tile_layout)
    key_vector: gl.constexpr = gl.SliceLayout(0, tile_layout)
    logit_scale = scale * LOG2E
    zeros_tile = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=tile_layout)
    zeros_grad_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)

    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        block, batch_head, earlier = work_item(item, SEQ_LEN, BLOCK_N)
        keys = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_vector)
        in_keys = keys < SEQ_LEN
        grad_k = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32,
                                             layout=acc_layout))
        grad_v = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32,
                                             layout=acc_layout))
        mbarrier.wait(kv_ready, earlier & 1)                    # k, v [BN,D]
        for step in range(NUM_TILES):
            m_tile = walk_tile(step, block, NUM_TILES, ROTATED_WALK)
            tile_count = earlier * NUM_TILES + step
            slot = tile_count % NUM_STAGES
            queries = m_tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=query_vector)
            in_queries = queries < SEQ_LEN
            row_stats = batch_head * SEQ_LEN + queries
            lse = gl.load(LSE_LOG2 + row_stats, mask=in_queries, other=0.0)
            delta = gl.load(DELTA + row_stats, mask=in_queries, other=0.0)
            mbarrier.wait(ready.index(slot), (tile_count // NUM_STAGES) & 1)
            q = q_ring.index(slot)                                          # [BM,D]
            grad_attn = grad_attn_ring.index(slot)                          # [BM,D]
            # in flight: dK of the previous step
            logits = warpgroup_mma(q, k_tile.permute((1, 0)), zeros_tile, use_acc=False,
                                   is_async=True)                           # [BM,BN]
            grad_p = warpgroup_mma(grad_attn, v_tile.permute((1, 0)), zeros_tile,
                                   use_acc=False, is_async=True)            # [BM,BN]
            logits = warpgroup_mma_wait(1, deps=(logits,))
            if step > 0:               # dV, dK of the previous step are done with its slot
                release_slot(tile_count - 1, empty, grad_q_full, NUM_STAGES, GRAD_Q_BUFFERS,
                             DEFERRED_GRAD_Q)
            valid = in_queries[:, None] & in_keys[None, :]
            probs = gl.where(valid, gl.exp2(logits * logit_scale - lse[:, None]), 0.0)
            probs_tile.store(probs.to(dtype))        # the previous dV is done with it
            fence_async_shared()
            cta_barrier()
            grad_v = warpgroup_mma(probs_tile.permute((1, 0)), grad_attn, grad_v,
                                   is_async=True)                           # [BN,D]
            grad_p = warpgroup_mma_wait(1, deps=(grad_p,))                  # dV on
            grad_s = (probs * (grad_p - delta[:, None])).to(dtype)          # [BM,BN]
            grad_s_tile.store(grad_s)      # the previous dK, dQ are done with it
            fence_async_shared()
            cta_barrier()
            grad_q = warpgroup_mma(grad_s_tile, k_tile, zeros_grad_q, use_acc=False,
                                   is_async=True)                           # [BM,D]
            grad_k = warpgroup_mma(grad_s_tile.permute((1, 0)), q, grad_k,
                                   is_async=True)                           # [BN,D]
            grad_q = warpgroup_mma_wait(1, deps=(grad_q,))                  # dK on
            stage_grad_q(grad_q, tile_count, grad_q_ring, grad_q_empty, GRAD_Q_BUFFERS)
            if not DEFERRED_GRAD_Q:    # else handed over at the next tile's barrier
                fence_async_shared()
                cta_barrier()
                mbarrier.arrive(grad_q_full.index(tile_count % GRAD_Q_BUFFERS), count=1)
        grad_k, grad_v = warpgroup_mma_wait(0, deps=(grad_k, grad_v))
        release_slot((earlier + 1) * NUM_TILES - 1, empty, grad_q_full, NUM_STAGES,
                     GRAD_Q_BUFFERS, DEFERRED_GRAD_Q)                  # the item's last
        mbarrier.arrive(kv_empty, count=1)
        store_grad_kv(grad_k, grad_v, probs_tile, block, batch_head, GRAD_QKV, scale,
                      NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_N, num_warps)


@gluon.jit
def attention_bwd_ws_kernel(q_desc, k_desc, v_desc, grad_attn_desc, LSE_LOG2, DELTA,
                            grad_q_sum_desc, SEMAPHORES, GRAD_QKV, scale,
                            num_items, NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                            HEADS_IN_ROWS: gl.constexpr, WORKER_REGISTERS: gl.constexpr,
                            GRAD_Q_BUFFERS: gl.constexpr, ROTATED_WALK: gl.constexpr,
                            DEFERRED_GRAD_Q: gl.constexpr, num_warps: gl.constexpr):
    """dQ | dK | dV into GRAD_QKV [B,S,3E] (the operands' dtype; head h's columns at
    h * D, E + h * D and 2E + h * D: a QKV projection's layout) of the work items this
    program takes (module docstring) of num_items = ceil(S / BLOCK_N) * B * NUM_HEADS,
    item i being keys [(i % ceil(S / BLOCK_N)) * BLOCK_N, + BLOCK_N) of (batch * NUM_HEADS
    + head) = i // ceil(S / BLOCK_N); a 1-D grid of one program per item, or of fewer
    all resident at once (a cooperative launch: module docstring). q_desc,
    grad_attn_desc: TMA descriptors of [BM,D] tiles; k_desc, v_desc of [BN,D] tiles
    (head_coordinates says where a head lies). LSE_LOG2, DELTA [B,H,S] float32
    (base-2 log-sum-exp of the logits * scale, rowsum(dO * O): attention_delta_kernel's);
    grad_q_sum_desc: a TMA descriptor of [BM,D] tiles of the float32 dQ sums
    [B*H * ceil(S / BM) * BM, D]
    (scratch, never zeroed: tile m of a head at row (head * ceil(S / BM) + m) * BM);
    SEMAPHORES [B*H, ceil(S / BM)] int32 zeros (attention_delta_kernel clears them).
    BLOCK_M = 16 * num_warps (one consumer warpgroup per 64 queries); GRAD_Q_BUFFERS (1
    or 2) dQ tiles handed to the writer at once; the producer and the dQ writer, one
    warp each, keep WORKER_REGISTERS registers per thread."""
    gl.static_assert(BLOCK_M == 16 * num_warps, "one consumer warpgroup per 64 queries")
    if ROTATED_WALK:
        gl.static_assert(BLOCK_M == BLOCK_N, "as many key blocks as query tiles")
    dtype: gl.constexpr = q_desc.dtype
    k_tile = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_tile = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    grad_attn_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM],
                                               grad_attn_desc.layout)
    score_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N],
                                                                      dtype)
    grad_s_tile = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], score_layout)
    grad_q_ring = gl.allocate_shared_memory(gl.float32, [GRAD_Q_BUFFERS, BLOCK_M, HEAD_DIM],
                                            grad_q_sum_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    grad_q_full = gl.allocate_shared_memory(gl.int64, [GRAD_Q_BUFFERS, 1],
                                            mbarrier.MBarrierLayout())
    grad_q_empty = gl.allocate_shared_memory(gl.int64, [GRAD_Q_BUFFERS, 1],
                                             mbarrier.MBarrierLayout())
    sum_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(sum_ready, count=1)
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(kv_empty, count=1)
    for stage in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=1)
    for buffer in gl.static_range(GRAD_Q_BUFFERS):
        mbarrier.init(grad_q_full.index(buffer), count=1)
        mbarrier.init(grad_q_empty.index(buffer), count=1)
    fence_async_shared()
    probs_tile = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], score_layout)

    gl.warp_specialize([
        (compute_partition, (k_tile, v_tile, q_ring, grad_attn_ring, probs_tile, grad_s_tile,
                             grad_q_ring, kv_ready, kv_empty, ready, empty, grad_q_full,
                             grad_q_empty, LSE_LOG2, DELTA, GRAD_QKV, scale, num_items,
                             NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                             GRAD_Q_BUFFERS, ROTATED_WALK, DEFERRED_GRAD_Q, num_warps)),
        (load_partition, (q_desc, k_desc, v_desc, grad_attn_desc, k_tile, v_tile, q_ring,
                          grad_attn_ring, kv_ready, kv_empty, ready, empty, num_items,
                          NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                          HEADS_IN_ROWS, ROTATED_WALK)),
        (grad_q_partition, (grad_q_ring, grad_q_full, grad_q_empty, sum_ready,
                            grad_q_sum_desc, SEMAPHORES, GRAD_QKV, scale, num_items,
                            NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_M, BLOCK_N, GRAD_Q_BUFFERS,
                            ROTATED_WALK)),
    ], [1, 1], [WORKER_REGISTERS, WORKER_REGISTERS])


@gluon.jit
def attention_delta_kernel(GRAD_ATTN, ATTN_OUT, LSE, DELTA, LSE_LOG2, SEMAPHORES,
                           NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
                           HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, HEADS: gl.constexpr,
                           THREADS_HEADS: gl.constexpr, QUERY_TILES: gl.constexpr,
                           QUERY_TILES_POW2: gl.constexpr, num_warps: gl.constexpr):
    """What attention_bwd_ws_kernel reads and nothing computes before it: DELTA [B,H,S]
    float32 = rowsum(dO * O) per head, from GRAD_ATTN and ATTN_OUT [B,S,E]; LSE_LOG2
    [B,H,S] = LSE * log2(e), the log-sum-exp in base 2 (scaled here, the main kernel
    has no multiply waiting for its load before it issues a tile's first products:
    measured, 2% of its time); and its SEMAPHORES [B*H, QUERY_TILES]
    set to 0, so that no launch of its own clears them. A program takes BLOCK rows of
    HEADS consecutive heads ([BLOCK, HEADS, D] of each input: with all heads, whole rows
    of E), THREADS_HEADS of a warp's threads across the heads; program ids (batch *
    NUM_HEADS // HEADS + head group, row block), the grid's first dimension having no
    65,535 limit. The programs of the first row block clear their heads' semaphores."""
    layout: gl.constexpr = gl.BlockedLayout(
        [1, 1, 8], [256 // (THREADS_HEADS * HEAD_DIM), THREADS_HEADS, HEAD_DIM // 8],
        [num_warps, 1, 1], [2, 1, 0])
    stats_layout: gl.constexpr = gl.SliceLayout(2, layout)                 # [BLOCK, HEADS]
    group = gl.program_id(0)
    batch = group // (NUM_HEADS // HEADS)
    first_head = group % (NUM_HEADS // HEADS) * HEADS
    row_block = gl.program_id(1)
    rows = row_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, stats_layout))
    heads = first_head + gl.arange(0, HEADS, layout=gl.SliceLayout(0, stats_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    row_offsets = (batch * SEQ_LEN + rows).to(gl.int64) * (NUM_HEADS * HEAD_DIM)
    offsets = (gl.expand_dims(gl.expand_dims(row_offsets, 1), 2)
               + gl.expand_dims(gl.expand_dims(heads * HEAD_DIM, 0), 2)
               + gl.expand_dims(gl.expand_dims(cols, 0), 1))         # [BLOCK, HEADS, D]
    in_rows = gl.expand_dims(gl.expand_dims(rows < SEQ_LEN, 1), 2)
    grad_attn = gl.load(GRAD_ATTN + offsets, mask=in_rows, other=0.0).to(gl.float32)
    attn_output = gl.load(ATTN_OUT + offsets, mask=in_rows, other=0.0).to(gl.float32)
    stats = ((batch * NUM_HEADS + heads).to(gl.int64) * SEQ_LEN)[None, :] + rows[:, None]
    in_stats = (rows < SEQ_LEN)[:, None]
    gl.store(DELTA + stats, gl.sum(grad_attn * attn_output, axis=2), mask=in_stats)
    gl.store(LSE_LOG2 + stats, gl.load(LSE + stats, mask=in_stats) * LOG2E, mask=in_stats)
    tiles = gl.arange(0, QUERY_TILES_POW2, layout=gl.SliceLayout(1, stats_layout))
    semaphores = ((batch * NUM_HEADS + heads) * QUERY_TILES)[None, :] + tiles[:, None]
    gl.store(SEMAPHORES + semaphores,                              # [QUERY_TILES_POW2, HEADS]
             gl.zeros([QUERY_TILES_POW2, HEADS], gl.int32, stats_layout),
             mask=(tiles < QUERY_TILES)[:, None] & (row_block == 0))
