"""Compile-only probe (sm_90, no launch): P's rows fed by TMA through four phase
descriptors (rows g = 4 i + p of P viewed [B*H*S, S]: base element 576 p, row stride
2308 floats), a [128, 32] tile of the rows pass as four boxes [32, 32], read by the
consumers into the wgmma accumulator layout. Prints the descriptor layout, shared
memory, the TMA copies and the shared-memory loads of the PTX."""
import collections
import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from vitattn_bwd.kernels.gluon_compat import compile_without_launch, tma_load
from vitattn_bwd.kernels.softmax_bwd_gluon import wgmma_layout


@gluon.jit
def probe_kernel(d0, d1, d2, d3, OUT, G0, NUM_WARPS: gl.constexpr):
    tile = gl.allocate_shared_memory(gl.float32, [128, 32], d0.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, 4 * d0.block_type.nbytes)
    for s in gl.static_range(4):
        g = G0 + s
        phase = g % 4
        row = g // 4
        dest = tile.slice(32 * s, 32, dim=0)
        if phase == 0:
            tma_load(d0, [row, 0], bar, dest)
        elif phase == 1:
            tma_load(d1, [row, 1], bar, dest)
        elif phase == 2:
            tma_load(d2, [row, 2], bar, dest)
        else:
            tma_load(d3, [row, 3], bar, dest)
    mbarrier.wait(bar, 0)
    layout: gl.constexpr = wgmma_layout(NUM_WARPS, 32)
    p = tile.load(layout)
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
    gl.store(OUT + rows[:, None] * 32 + cols[None, :], p)


layout = gl.NVMMASharedLayout.get_default_for([32, 32], gl.float32)
print("descriptor layout", layout)
desc = f"tensordesc<fp32[32, 32],{layout!r}>"
kernel = compile_without_launch(
    probe_kernel, dict(d0=desc, d1=desc, d2=desc, d3=desc, OUT="*fp32", G0="i32",
                       NUM_WARPS="constexpr"), dict(NUM_WARPS=8), 90, num_warps=8)
print("shared bytes", kernel.metadata.shared)
ptx = kernel.asm["ptx"]
print("ptx", collections.Counter(re.findall(
    r"\b(ld\.shared[.\w]*|cp\.async\.bulk\.tensor[.\w]*)", ptx)))
