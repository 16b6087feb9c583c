"""Prototype, not package code (session 9): the pattern a producer-warp attention core
would use, compiled for sm_90 on the CPU only (never run: no device time was left).

A gl.warp_specialize kernel: PRODUCER_WARPS warps stream float32 P tiles [BLOCK_M,
BLOCK_N] (rows of 577 floats, 4-byte aligned: cp.async of 4 bytes per element, no TMA)
into a STAGES-deep shared-memory ring, each slot signalled by an mbarrier that the
copies themselves complete (async_copy.mbarrier_arrive); the 4-warp consumer waits on a
slot, loads it into the wgmma accumulator layout, and frees it through a second
mbarrier. Here the consumer only sums the tiles.

What compiled (triton 3.6, ptxas for sm_90a;
`python3 docs/prototypes/warp_specialized_p_stream.py` prints it):

    producer warps, registers   spill stores   kernel registers (consumer setmaxnreg)
    1, 40                       476 B          255 (256)
    4, 56                       0              255 (256)
    4, 80                       0              255 (256)
    2, 88                       0              255 (256)

So one producer warp cannot hold a 64 x 32 tile's 64 pointers per thread in 40
registers; 2-4 warps can. Triton raises the consumer to 256 registers, so a block of
4 consumer warps plus its producer takes 40K of the SM's 64K registers: one block per
SM, against 3 blocks of 4 warps for today's rows kernel. The design that would pay is
FlashAttention-3's: 2-3 consumer warpgroups per block (each its own 64 query rows,
sharing the k / v tiles a producer stages) and one producer, one block per SM.
"""
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon._runtime import GluonASTSource


@gluon.jit
def producer(PROBS, ring, ready, empty, m_start, PRODUCER_WARPS: gl.constexpr, SEQ_LEN: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_TILES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    rows = gl.minimum(m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)), SEQ_LEN - 1)
    for tile in range(NUM_TILES):
        slot = tile % STAGES
        phase = (tile // STAGES) & 1
        mbarrier.wait(empty.index(slot), phase ^ 1)
        cols = gl.minimum(tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout)), SEQ_LEN - 1)
        async_copy.async_copy_global_to_shared(ring.index(slot), PROBS + rows[:, None] * SEQ_LEN + cols[None, :])
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)


@gluon.jit
def consumer(OUT, ring, ready, empty, m_start, SEQ_LEN: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_TILES: gl.constexpr, num_warps: gl.constexpr):
    tile_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=tile_layout)
    for tile in range(NUM_TILES):
        slot = tile % STAGES
        phase = (tile // STAGES) & 1
        mbarrier.wait(ready.index(slot), phase)
        p = ring.index(slot).load(tile_layout)
        mbarrier.arrive(empty.index(slot))
        acc += p
    rows = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, tile_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, tile_layout))
    gl.store(OUT + rows[:, None] * BLOCK_N + cols[None, :], acc)


@gluon.jit
def stream_kernel(PROBS, OUT, SEQ_LEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    NUM_TILES: gl.constexpr = (SEQ_LEN + BLOCK_N - 1) // BLOCK_N
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M, BLOCK_N], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    m_start = gl.program_id(0) * BLOCK_M
    gl.warp_specialize([(consumer, (OUT, ring, ready, empty, m_start, SEQ_LEN, BLOCK_M, BLOCK_N, STAGES, NUM_TILES, num_warps)),
                        (producer, (PROBS, ring, ready, empty, m_start, PRODUCER_WARPS, SEQ_LEN, BLOCK_M, BLOCK_N, STAGES, NUM_TILES))],
                       [PRODUCER_WARPS], [PRODUCER_REGS])


def main():
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    print("producer warps, registers | shared bytes | spill stores | registers | setmaxnreg")
    for producer_warps, producer_regs in ((1, 40), (4, 56), (4, 80), (2, 88)):
        constexprs = dict(SEQ_LEN=577, BLOCK_M=64, BLOCK_N=32, STAGES=4,
                          PRODUCER_WARPS=producer_warps, PRODUCER_REGS=producer_regs,
                          num_warps=4)
        signature = {"PROBS": "*fp32", "OUT": "*fp32", **dict.fromkeys(constexprs, "constexpr")}
        compiled = triton.compile(GluonASTSource(stream_kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        ptx = compiled.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "kernel.ptx"
            source.write_text(ptx)
            report = subprocess.run([str(tools / "ptxas"), "-v", "-arch=sm_90a", str(source),
                                     "-o", str(Path(tmp) / "kernel.cubin")],
                                    capture_output=True, text=True, check=True).stderr
        print(producer_warps, producer_regs, compiled.metadata.shared,
              re.search(r"(\d+) bytes spill stores", report)[1],
              re.search(r"Used (\d+) registers", report)[1],
              re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ptx)[-2:])


if __name__ == "__main__":
    main()
