"""Prototype, not package code: the dQ-mode diagnostic that docs/performance.md's plan for
the warp-specialized core starts with ("What bounds the warp-specialized core", step 0).
Written and compiled for sm_90 on the CPU; not yet run on a GPU.

The package's attention_bwd_ws_kernel (vitattn_bwd/kernels/attention_bwd_ws.py) with
its producer and consumer partitions as they are, and its dQ writer in one of three
modes (DQ_MODE):

    0 ordered    the package's writer: each key block adds its dQ tiles in key-block
                 order, by polling a semaphore and releasing it (bitwise reproducible)
    1 unordered  the same stores, adds and last-block pass, without the poll and the
                 release: blocks add in any order (dQ non-deterministic, and wrong
                 where a block's add lands before block 0's store: timing only)
    2 drop       the writer takes each tile and gives its buffer back, writing nothing
                 (dQ not computed: timing only)

How to read the times (the plan's table): drop near 0.3-0.45 ms says the writer bounds
the kernel and drop's time is the consumers' bound; unordered near drop says the
ordering (polls, fences, the chain of key blocks) is the cost; unordered near ordered
says one warp's 64 adds and ~770 instructions per tile are; drop near ordered (0.9 ms)
says the consumers bound it and the writer reading is wrong.

    PYTHONPATH=. python3 docs/prototypes/ws_dq_modes.py --batch 32     # GPU, ~1 minute
    PYTHONPATH=. python3 docs/prototypes/ws_dq_modes.py --sm90         # CPU: resources

On the GPU (bf16, head dim 64, 577 tokens, 16 heads, time_core_half's inputs), for each
configuration of CONFIGURATIONS and each mode: the median time of the delta kernel and
the main kernel (L2 flushed, triton.testing.do_bench), and for mode 0 whether dQ, dK,
dV equal the package launch's bits. A first call that has not ended after 120 s ends the
process (time_core_ws.deadline). --batch 1 as well: one round of programs, about
one program's latency.

Compiled for sm_90 with triton 3.6.0 (--sm90, docs/runs/kernels/ws_dq_modes_sm90.txt):
every mode keeps the consumers' 24 (BN 64) or 32 (BN 128) HGMMA and 4 wgmma waits, and
modes 0 and 1 the writer's 64 REDG per middle-block tile. But mode 1 spills 540-580
bytes at the configured 56 worker registers (mode 0: none), 296-484 at 64-80 (mode 0:
0-80); from 88 up ptxas serializes every consumer wgmma (24 waits), so no worker budget
compares the two cleanly. The cause of mode 1's spills was not found (keeping the release's
barrier, or one semaphore read per tile, changes nothing). So mode 1's time is an upper
bound of an unordered writer's at this register budget.
"""
import argparse
import json
import re
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from vitattn_bwd import attention_bwd_ws  # noqa: E402
from vitattn_bwd.kernels.gluon_compat import cta_barrier  # noqa: E402
from vitattn_bwd.kernels.attention_bwd_ws import (compute_partition,  # noqa: E402
                                                  grad_q_chunk, grad_q_partition,
                                                  load_partition)

MODES = {0: "ordered", 1: "unordered", 2: "drop"}
CONFIGURATIONS = attention_bwd_ws.TILES + attention_bwd_ws.CANDIDATE_TILES


@gluon.jit
def grad_q_writer(grad_q_ring, grad_q_full, grad_q_empty, DQ_ACCUM, SEMAPHORES, GRAD_Q,
                  scale, NUM_HEADS: gl.constexpr, SEQ_LEN: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, CHUNK_ROWS: gl.constexpr,
                  DQ_MODE: gl.constexpr):
    """The package's dQ writer (DQ_MODE 0), or its stores and adds without the order
    (1), or nothing but the buffer hand-back (2)."""
    if DQ_MODE == 0:
        grad_q_partition(grad_q_ring, grad_q_full, grad_q_empty, DQ_ACCUM, SEMAPHORES,
                         GRAD_Q, scale, NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_M, CHUNK_ROWS)
    else:
        NUM_TILES: gl.constexpr = (SEQ_LEN + BLOCK_M - 1) // BLOCK_M
        layout: gl.constexpr = gl.BlockedLayout([1, HEAD_DIM // 32], [1, 32], [1, 1], [1, 0])
        block = gl.program_id(0)
        last = gl.num_programs(0) - 1
        batch_head = gl.program_id(1)
        batch = batch_head // NUM_HEADS
        head = batch_head % NUM_HEADS
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        chunk_rows = gl.arange(0, CHUNK_ROWS, layout=gl.SliceLayout(1, layout))
        accum_head = DQ_ACCUM + batch_head.to(gl.int64) * SEQ_LEN * HEAD_DIM
        for m_tile in range(NUM_TILES):
            buffer = m_tile % 2
            mbarrier.wait(grad_q_full.index(buffer), (m_tile // 2) & 1)
            tile_ring = grad_q_ring.index(buffer)
            # DQ_MODE 1: the package writer's three paths as it has them, no poll
            if DQ_MODE == 1 and block == last:
                for chunk in gl.static_range(BLOCK_M // CHUNK_ROWS):
                    tile, accum, rows, in_rows = grad_q_chunk(
                        tile_ring, chunk, m_tile, accum_head, chunk_rows, cols, SEQ_LEN,
                        HEAD_DIM, BLOCK_M, CHUNK_ROWS, layout)
                    if block > 0:
                        tile += gl.load(accum, mask=in_rows, other=0.0, cache_modifier=".cg")
                    out = (GRAD_Q + ((batch * SEQ_LEN + rows).to(gl.int64) * NUM_HEADS
                                     * HEAD_DIM)[:, None] + head * HEAD_DIM + cols[None, :])
                    gl.store(out, (tile * scale).to(GRAD_Q.dtype.element_ty), mask=in_rows)
            elif DQ_MODE == 1 and block == 0:
                for chunk in gl.static_range(BLOCK_M // CHUNK_ROWS):
                    tile, accum, rows, in_rows = grad_q_chunk(
                        tile_ring, chunk, m_tile, accum_head, chunk_rows, cols, SEQ_LEN,
                        HEAD_DIM, BLOCK_M, CHUNK_ROWS, layout)
                    gl.store(accum, tile, mask=in_rows)
            elif DQ_MODE == 1:
                for chunk in gl.static_range(BLOCK_M // CHUNK_ROWS):
                    tile, accum, rows, in_rows = grad_q_chunk(
                        tile_ring, chunk, m_tile, accum_head, chunk_rows, cols, SEQ_LEN,
                        HEAD_DIM, BLOCK_M, CHUNK_ROWS, layout)
                    gl.atomic_add(accum, tile, mask=in_rows, sem="relaxed", scope="gpu")
            mbarrier.arrive(grad_q_empty.index(buffer), count=1)
            if DQ_MODE == 1:
                cta_barrier()          # as the package's writer before its release


@gluon.jit
def ws_dq_mode_kernel(q_desc, k_desc, v_desc, grad_attn_desc, LSE, DELTA, DQ_ACCUM,
                      SEMAPHORES, GRAD_Q, GRAD_KV, scale, NUM_HEADS: gl.constexpr,
                      SEQ_LEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                      HEADS_IN_ROWS: gl.constexpr, WORKER_REGISTERS: gl.constexpr,
                      GRAD_Q_CHUNK_ROWS: gl.constexpr, DQ_MODE: gl.constexpr,
                      num_warps: gl.constexpr):
    """attention_bwd_ws_kernel (its shared memory, barriers and partitions as they are)
    with grad_q_writer in DQ_MODE."""
    dtype: gl.constexpr = q_desc.dtype
    k_tile = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_tile = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    grad_attn_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM],
                                               grad_attn_desc.layout)
    grad_s_tile = gl.allocate_shared_memory(
        dtype, [BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M],
                                                                        dtype))
    grad_q_ring = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM],
                                            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    grad_q_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    grad_q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for stage in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=1)
    for buffer in gl.static_range(2):
        mbarrier.init(grad_q_full.index(buffer), count=1)
        mbarrier.init(grad_q_empty.index(buffer), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (compute_partition, (k_tile, v_tile, q_ring, grad_attn_ring, grad_s_tile,
                             grad_q_ring, kv_ready, ready, empty, grad_q_full, grad_q_empty,
                             LSE, DELTA, GRAD_KV, scale, NUM_HEADS, SEQ_LEN, HEAD_DIM,
                             BLOCK_M, BLOCK_N, NUM_STAGES, num_warps)),
        (load_partition, (q_desc, k_desc, v_desc, grad_attn_desc, k_tile, v_tile, q_ring,
                          grad_attn_ring, kv_ready, ready, empty, NUM_HEADS, SEQ_LEN,
                          HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, HEADS_IN_ROWS)),
        (grad_q_writer, (grad_q_ring, grad_q_full, grad_q_empty, DQ_ACCUM, SEMAPHORES,
                         GRAD_Q, scale, NUM_HEADS, SEQ_LEN, HEAD_DIM, BLOCK_M,
                         GRAD_Q_CHUNK_ROWS, DQ_MODE)),
    ], [1, 1], [WORKER_REGISTERS, WORKER_REGISTERS])


def launch(q, k, v, grad_attn, attn_output, lse, scale, tiles, dq_mode):
    """attention_bwd_ws.launch with the writer in dq_mode: (grad_q, grad_kv)."""
    heads_in_rows = attention_bwd_ws._heads_in_rows(q)
    batch, heads, seq_len, head_dim = q.shape
    delta, semaphores = attention_bwd_ws.launch_delta(grad_attn, attn_output, heads,
                                                      tiles.block_m)
    grad_q_accum = q.new_empty(batch * heads, seq_len, head_dim, dtype=torch.float32)
    grad_q = q.new_empty(batch, seq_len, heads * head_dim)
    grad_kv = q.new_empty(batch, seq_len, 2 * heads * head_dim)
    descriptor = attention_bwd_ws._descriptor
    ws_dq_mode_kernel[(-(-seq_len // tiles.block_n), batch * heads)](
        descriptor(q, heads_in_rows, tiles.block_m, head_dim),
        descriptor(k, heads_in_rows, tiles.block_n, head_dim),
        descriptor(v, heads_in_rows, tiles.block_n, head_dim),
        descriptor(grad_attn, False, tiles.block_m, head_dim),
        lse, delta, grad_q_accum, semaphores, grad_q, grad_kv, scale,
        **attention_bwd_ws.kernel_constexprs(heads, seq_len, head_dim, tiles, heads_in_rows),
        DQ_MODE=dq_mode, maxnreg=tiles.maxnreg)
    return grad_q, grad_kv


def compile_sm90(tiles, dq_mode, seq_len=577, num_heads=16, head_dim=64):
    """ws_dq_mode_kernel compiled for sm_90 (bf16, QKV head views), launching nothing."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    constexprs = dict(attention_bwd_ws.kernel_constexprs(num_heads, seq_len, head_dim, tiles,
                                                         False), DQ_MODE=dq_mode)

    def descriptor(rows):
        layout = attention_bwd_ws._shared_layout([rows, head_dim], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"
    signature = dict(q_desc=descriptor(tiles.block_m), k_desc=descriptor(tiles.block_n),
                     v_desc=descriptor(tiles.block_n), grad_attn_desc=descriptor(tiles.block_m),
                     LSE="*fp32", DELTA="*fp32", DQ_ACCUM="*fp32", SEMAPHORES="*i32",
                     GRAD_Q="*bf16", GRAD_KV="*bf16", scale="fp32")
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in ws_dq_mode_kernel.arg_names}
    aligned = {(index,): [["tt.divisibility", 16]]
               for index, kind in enumerate(signature.values()) if kind[0] == "*"}
    return triton_compile(GluonASTSource(ws_dq_mode_kernel, signature, constexprs=constexprs,
                                         attrs=aligned),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tiles.num_warps, maxnreg=tiles.maxnreg))


def sm90_report():
    """Per configuration and mode: shared bytes, spill stores, HGMMA and wgmma-wait counts,
    and the writer's global atomics (RED / ATOM) and polls in the SASS."""
    from kernel_resources import ptxas_report_and_sass
    report = []
    for tiles in CONFIGURATIONS:
        for mode, name in MODES.items():
            compiled = compile_sm90(tiles, mode)
            notes, sass = ptxas_report_and_sass(compiled)
            report.append(dict(
                tiles=list(tiles), mode=name, shared_bytes=compiled.metadata.shared,
                spill_stores=int(re.search(r"(\d+) bytes spill stores", notes)[1]),
                hgmma=len(re.findall(r"\bHGMMA\b", sass)),
                waits=len(re.findall(r"WARPGROUP\.DEPBAR", sass)),
                global_reductions=len(re.findall(r"\bREDG\b|\bRED\.", sass)),
                global_atomics=len(re.findall(r"\bATOMG\b|\bATOM\.", sass)),
                instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))))
    return report


def gpu_main(batches):
    from time_core_gluon import bench
    from time_core_half import SCALE, make_inputs
    from time_core_ws import deadline
    results = []
    for batch in batches:
        q, k, v, grad_attn, attn_output, lse = make_inputs(batch, torch.bfloat16, seed=batch)
        for tiles in CONFIGURATIONS:
            reference = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE,
                                                tiles)
            for mode, name in MODES.items():
                def run(mode=mode, tiles=tiles):
                    return launch(q, k, v, grad_attn, attn_output, lse, SCALE, tiles, mode)
                with deadline(120, f"{name} {tuple(tiles)} at batch {batch}"):
                    first = run()            # compiles; a writer that never ends is ended
                    torch.cuda.synchronize()
                same_bits = (all(torch.equal(a, b) for a, b in zip(first, reference))
                             if mode == 0 else None)
                row = dict(batch=batch, tiles=list(tiles), mode=name, ms=bench(run),
                           same_bits_as_package=same_bits)
                print(json.dumps(row), flush=True)
                results.append(row)
    print("\n| batch | tiles | ordered ms | unordered ms | drop ms | ordered = package bits |")
    print("|---|---|---|---|---|---|")
    for batch in batches:
        for tiles in CONFIGURATIONS:
            rows = {r["mode"]: r for r in results
                    if r["batch"] == batch and r["tiles"] == list(tiles)}
            print(f"| {batch} | {tuple(tiles)} | {rows['ordered']['ms']:.3f} | "
                  f"{rows['unordered']['ms']:.3f} | {rows['drop']['ms']:.3f} | "
                  f"{rows['ordered']['same_bits_as_package']} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sm90", action="store_true", help="compile for sm_90 and print "
                        "each configuration's resources (no GPU needed)")
    args = parser.parse_args()
    if args.sm90:
        for row in sm90_report():
            print(json.dumps(row))
    else:
        gpu_main(list(dict.fromkeys((1, args.batch))))


if __name__ == "__main__":
    main()
