"""Which fp32 TMA box loads fault on sm_90? Each case in its own process."""
import subprocess
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, fence_async_shared
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from vitattn_bwd.kernels.gluon_compat import tma_load


@gluon.jit
def probe(desc, OUT, row, col, BR: gl.constexpr, BC: gl.constexpr):
    smem = gl.allocate_shared_memory(gl.float32, [BR, BC], desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, BR * BC * 4)
    tma_load(desc, [row, col], bar, smem)
    mbarrier.wait(bar, 0)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    x = smem.load(layout)
    r = gl.arange(0, BR, gl.SliceLayout(1, layout))[:, None]
    c = gl.arange(0, BC, gl.SliceLayout(0, layout))[None, :]
    gl.store(OUT + r * BC + c, x)


def case(base, inner_extra, col, swizzle, box_rows):
    S = 129
    p = torch.arange(2 * S * S, device="cuda", dtype=torch.float32)
    flat = p[base:]
    rows = (p.numel() - base) // (4 * S)
    shape = [rows, S + inner_extra]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=2)
    desc = TensorDescriptor(flat, shape, [4 * S, 1], [box_rows, 32], layout)
    out = torch.empty(box_rows, 32, device="cuda")
    probe[(1,)](desc, out, 1, col, box_rows, 32, num_warps=4)
    torch.cuda.synchronize()
    view = flat.as_strided(shape, (4 * S, 1))
    want = torch.zeros(box_rows, 32, device="cuda")
    part = view[1:1 + box_rows, col:col + 32]
    want[:part.shape[0], :part.shape[1]] = part
    return torch.equal(out, want)


CASES = {
    "aligned": (0, 0, 0, 128, 32),
    "col1": (0, 0, 1, 128, 32),
    "col4": (0, 0, 4, 128, 32),
    "base128_inner1": (128, 1, 0, 128, 32),
    "base128_inner1_col1": (128, 1, 1, 128, 32),
    "col1_noswizzle": (0, 0, 1, 0, 32),
    "col1_swizzle64": (0, 0, 1, 64, 32),
    "col1_rows8": (0, 0, 1, 128, 8),
}
if __name__ == "__main__":
    if len(sys.argv) > 1:
        print("RESULT", case(*CASES[sys.argv[1]]))
    else:
        for name in CASES:
            r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True)
            tail = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()][-1:]
            print(f"{name:24s} rc={r.returncode} {tail[0][:150] if tail else ''}", flush=True)
