"""Host side of the warp-specialized one-pass attention-core backward
(kernels/attention_bwd_ws.py): its launch configurations, a launcher (its two kernels
launched through launcher.py's cache of compiled kernels), and a compile for sm_90 that
launches nothing (for the CPU checks of its machine code).

    launch(q, k, v, grad_attn, attn_output, lse, scale, tiles)
        -> grad_qkv [B,S,3E] (dQ | dK | dV per row, a QKV projection's layout), in q's
           dtype

q, k, v [B,H,S,D] bf16 / fp16 with one set of strides and a contiguous last dim:
contiguous, or the head views of a QKV projection [B,S,3E]; grad_attn and attn_output
[B,S,E] contiguous; lse [B,H,S] float32, the natural-log log-sum-exp of the scaled
logits. One product per matmul, P recomputed from lse: the backward of the stock
route's attention (deterministic_sdpa.py), not of the module's one-product path, whose
graph runs the two-pass kernels. Not an autotune choice of the registered lowerings.
Its fastest configuration is FASTEST_TILES (docs/performance.md, "The one-product core":
0.370 ms at batch 32 with its delta kernel; `scripts/time_kernels.py --kernel core_ws`
times every configuration).
"""
import functools
import math
from typing import NamedTuple

import torch

from . import buffers, compile_probe, launcher
from .precision import HALF_DTYPES


class WsTiles(NamedTuple):
    """One launch configuration: BLOCK_M queries per tile of the walk and BLOCK_N keys per
    work item (both 128: one consumer warpgroup per 64 queries, num_warps = BLOCK_M //
    16), NUM_STAGES slots of q and dO tiles in the ring, the registers per thread the
    launch asks for (maxnreg), those the producer and dQ-writer warps keep (setmaxnreg;
    the consumers get the rest), whether the grid is one program per SM, each walking
    its share of the (head, key block) items (persistent, a cooperative launch), or one
    program per item; grad_q_buffers (1 or 2) dQ tiles handed to the writer at once;
    rotated_walk: key block b walks the query tiles from tile b on (a persistent grid;
    the kernel's docstring); grad_q_swizzle: the swizzle in bytes (0, 32, 64 or 128) of
    the dQ tiles in shared memory; deferred_grad_q: each dQ tile handed to the writer at
    the next tile's first barrier rather than with a fence and barrier of its own."""
    block_m: int
    block_n: int
    num_stages: int
    maxnreg: int
    worker_registers: int = 40
    persistent: bool = False
    grad_q_buffers: int = 2
    rotated_walk: bool = False
    grad_q_swizzle: int = 0
    deferred_grad_q: bool = False

    @property
    def num_warps(self):
        return self.block_m // 16


# The head dim the tiles are sized for: at 128 x 128 tiles shared memory holds head dim
# 64 (229,740 bytes of 232,448 compiled for sm_90) and no more; Gluon's tiles take
# powers of two only (48 and 96 do not compile), and 16 and 32 have not run on a GPU.
HEAD_DIM = 64
# The fastest configuration measured on the H200 (the module docstring), the launch the
# deterministic attention of the stock route uses: two consumer warpgroups and two
# worker warps (384 threads with the padding warps: at most 170 registers each at
# launch; the consumers get 240), 2 stages (3 with one dQ buffer fit shared memory too,
# and ran slower), the workers at 40 registers (at 24 the producer and the writer
# spilled 140 bytes); the dQ tiles with a 128-byte swizzle (0.387 ms against 0.404) and
# handed over at the next tile's barrier (0.389), both 0.370. No spills in the
# consumers' walk under triton 3.6.0 (5 reloads a tile under 3.9.0); 32 bytes of
# addresses reloaded once per work item.
FASTEST_TILES = WsTiles(128, 128, 2, 168, persistent=True, rotated_walk=True,
                        grad_q_swizzle=128, deferred_grad_q=True)
# Compiled for sm_90 without spills in the walk and with its wgmmas unserialized
# (tests/test_attention_bwd_ws.py, with the installed triton and the newest).
TILES = (FASTEST_TILES,)
# Timed beside TILES (scripts/time_kernels.py --kernel core_ws, batch 32, H200; FASTEST_TILES
# 0.370 ms: docs/performance.md, "The one-product core"): without the rotated walk,
# 0.503-0.569 ms; the rotated walk without the swizzle or the late hand-over or both,
# 0.387-0.404, and with three stages and one dQ buffer 0.421.
CANDIDATE_TILES = (WsTiles(128, 128, 2, 168, persistent=True),
                   WsTiles(128, 128, 2, 168, persistent=True, grad_q_buffers=1),
                   WsTiles(128, 128, 2, 168),
                   FASTEST_TILES._replace(grad_q_swizzle=0, deferred_grad_q=False),
                   FASTEST_TILES._replace(grad_q_swizzle=0),
                   FASTEST_TILES._replace(deferred_grad_q=False),
                   FASTEST_TILES._replace(grad_q_swizzle=0, grad_q_buffers=1, num_stages=3))


class DeltaTiles(NamedTuple):
    """attention_delta_kernel's launch: `block` rows a program, of `heads` consecutive
    heads (taken as the largest common divisor with the model's head count), num_warps
    warps."""
    block: int
    heads: int
    num_warps: int


DELTA_TILES = DeltaTiles(128, 1, 4)
# Timed beside DELTA_TILES (scripts/time_kernels.py --kernel core_ws, batch 32, bitwise
# its outputs): alone 0.033-0.044 ms against its 0.041, but with the main kernel
# 0.371-0.375 against its 0.372: none faster where it counts (the main kernel then reads
# dO partly from L2).
DELTA_CANDIDATE_TILES = (DeltaTiles(64, 1, 4), DeltaTiles(128, 1, 8), DeltaTiles(8, 16, 4),
                         DeltaTiles(16, 16, 8), DeltaTiles(32, 16, 8))


@functools.cache
def _shared_layout(block_shape, dtype):
    """The shared-memory layout of block_shape (a tuple) tiles of a Gluon dtype, made once:
    building one took ~18 us of host time on a CPU core, four of them a launch."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


def _gl_dtype(dtype):
    from triton.experimental.gluon import language as gl
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _heads_in_rows(q):
    """True for contiguous [B,H,S,D] q, k, v; False for head views of [B,S,3E]
    (row stride 3E, heads side by side); ValueError for any other strides."""
    batch, heads, seq_len, head_dim = q.shape
    if q.is_contiguous():
        return True
    if q.stride() == (seq_len * 3 * heads * head_dim, head_dim, 3 * heads * head_dim, 1):
        return False
    raise ValueError(f"q, k, v must be contiguous [B,H,S,D] or head views of a QKV "
                     f"projection [B,S,3E]; got q strides {q.stride()}")


def _descriptor(t, heads_in_rows, block_rows, head_dim):
    """A TMA descriptor of [block_rows, head_dim] tiles of t [B,H,S,D] (heads_in_rows:
    rows of [B*H*S, D]), of t [B,H,S,D] head views or of t [B,S,E] (rows of [B*S, E])."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    if t.dim() == 3:                                            # [B,S,E]
        shape, strides = [t.shape[0] * t.shape[1], t.shape[2]], [t.stride(1), 1]
    elif heads_in_rows:
        shape, strides = [t.numel() // head_dim, head_dim], [head_dim, 1]
    else:
        shape = [t.shape[0] * t.shape[2], t.shape[1] * head_dim]
        strides = [t.stride(2), 1]
    block = [block_rows, head_dim]
    return TensorDescriptor(t, shape, strides, block,
                            _shared_layout(tuple(block), _gl_dtype(t.dtype)))


@functools.cache
def _sum_layout(tiles):
    """The shared-memory layout of the float32 dQ tiles that the TMA copies move, with
    the configuration's swizzle (0: rows as they lie); made once per configuration."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout(swizzle_byte_width=tiles.grad_q_swizzle, element_bitwidth=32,
                                rank=2)


def _sum_descriptor(grad_q_sums, tiles):
    """A TMA descriptor of [BM,D] tiles of the float32 dQ sums [rows, D]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(grad_q_sums, list(grad_q_sums.shape), list(grad_q_sums.stride()),
                            [tiles.block_m, grad_q_sums.shape[1]], _sum_layout(tiles))


def padded_rows(batch, heads, seq_len, tiles):
    """Rows of lse, delta and the dQ sums as the kernels index them (B*H*S, the sums'
    padded to whole query tiles): in 32 bits, so below 2**31."""
    return batch * heads * -(-seq_len // tiles.block_m) * tiles.block_m


def fits(batch, heads, seq_len, sm_count, tiles=FASTEST_TILES):
    """Whether `launch` takes q [batch, heads, seq_len, HEAD_DIM] at `tiles` on a GPU of
    sm_count SMs, where it would refuse it otherwise (_check, program_count): rows
    within 32-bit indexing, and for a rotated walk a head's key blocks no more than the
    programs (one per SM: seq_len up to 128 x 132 = 16,896 tokens on an H200)."""
    key_blocks = -(-seq_len // tiles.block_n)
    programs = min(key_blocks * batch * heads, sm_count)
    return (padded_rows(batch, heads, seq_len, tiles) < 2**31
            and (not tiles.rotated_walk or programs >= key_blocks))


def program_count(tiles, num_items, sm_count, programs=None, blocks_per_head=1):
    """The grid: one program per (head, key block) item, or for a persistent
    configuration `programs` (default: one per SM), at most one per item. ValueError
    for `programs` given without a persistent configuration or not positive (fewer
    programs than items deadlock unless all are resident: a cooperative launch), and for
    a rotated walk on fewer programs than a head's blocks_per_head key blocks (a block
    waits on every other block of its head: all must be running)."""
    if programs is not None and (not tiles.persistent or programs < 1):
        raise ValueError(f"programs must be a positive count for a persistent "
                         f"configuration, got {programs} with {tiles}")
    count = min(num_items, programs or sm_count) if tiles.persistent else num_items
    if tiles.rotated_walk and count < blocks_per_head:
        raise ValueError(f"a rotated walk needs at least as many programs as key blocks "
                         f"per head ({blocks_per_head}), got {count}")
    return count


def _check(q, k, v, grad_attn, attn_output, lse, tiles):
    if q.dtype not in HALF_DTYPES or {k.dtype, v.dtype, grad_attn.dtype,
                                      attn_output.dtype} != {q.dtype}:
        raise ValueError(f"q, k, v, grad_attn, attn_output must share one dtype of "
                         f"{HALF_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}, "
                         f"{grad_attn.dtype}, {attn_output.dtype}")
    if len({q.stride(), k.stride(), v.stride()}) != 1:
        raise ValueError(f"q, k, v must share strides, got {q.stride()}, {k.stride()}, "
                         f"{v.stride()}")
    batch, heads, seq_len, head_dim = q.shape
    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim must be {HEAD_DIM}, got {head_dim}")
    for name, t in (("grad_attn", grad_attn), ("attn_output", attn_output)):
        if t.shape != (batch, seq_len, heads * head_dim) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [B,S,E] = "
                             f"{[batch, seq_len, heads * head_dim]}, got {list(t.shape)}")
    if lse.shape != (batch, heads, seq_len) or lse.dtype != torch.float32 \
            or not lse.is_contiguous():
        raise ValueError(f"lse must be contiguous float32 [B,H,S] = "
                         f"{[batch, heads, seq_len]}, got {lse.dtype} {list(lse.shape)}")
    # rows of lse, delta and the dQ sums are indexed in 32 bits (B*H*S rows, padded to
    # whole query tiles); tensors that large (>= 206 GB of q, k, v) fit no GPU today
    if padded_rows(batch, heads, seq_len, tiles) >= 2**31:
        raise ValueError(f"q's batch * heads * seq_len (seq_len rounded up to whole "
                         f"{tiles.block_m}-query tiles) must be below 2**31, got "
                         f"{list(q.shape)}")
    # TMA reads these from their first element: triton only asserts it (an
    # AssertionError from inside autograd, nothing under python -O)
    for name, t in (("q", q), ("k", k), ("v", v), ("grad_attn", grad_attn),
                    ("attn_output", attn_output)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address (TMA reads "
                             f"it), got {t.data_ptr():#x}; pass a copy (.clone())")
    if ((tiles.block_m, tiles.block_n) != (128, 128) or tiles.grad_q_buffers not in (1, 2)
            or tiles.grad_q_swizzle not in (0, 32, 64, 128)):
        raise ValueError(f"tiles must have block_m and block_n 128, grad_q_buffers 1 or 2 "
                         f"and grad_q_swizzle 0, 32, 64 or 128, got {tiles}")
    if tiles.rotated_walk and not tiles.persistent:
        raise ValueError(f"a rotated walk needs a persistent grid, got {tiles}")


def launch_delta(grad_attn, attn_output, lse, num_heads, block_m, tiles=DELTA_TILES):
    """(delta [B,H,S] float32 = rowsum(dO * O) per head, from grad_attn, attn_output
    [B,S,E]; lse [B,H,S] * log2(e); the main kernel's semaphores [B*H, ceil(S /
    block_m)] int32, zeroed), by attention_delta_kernel at `tiles` (DeltaTiles)."""
    from .kernels.attention_bwd_ws import attention_delta_kernel
    batch, seq_len, embed_dim = grad_attn.shape
    head_dim = embed_dim // num_heads
    heads = math.gcd(num_heads, tiles.heads)                   # heads per program
    delta = buffers.output_buffer(grad_attn, batch, num_heads, seq_len, dtype=torch.float32)
    query_tiles = -(-seq_len // block_m)
    semaphores = buffers.output_buffer(grad_attn, batch * num_heads, query_tiles,
                                       dtype=torch.int32)
    lse_log2 = buffers.output_buffer(grad_attn, batch, num_heads, seq_len,
                                     dtype=torch.float32)
    grid = (batch * num_heads // heads, -(-seq_len // tiles.block))
    launcher.launch(
        attention_delta_kernel, grid,
        grad_attn, attn_output, lse, delta, lse_log2, semaphores, NUM_HEADS=num_heads,
        SEQ_LEN=seq_len, HEAD_DIM=head_dim, BLOCK=tiles.block, HEADS=heads,
        THREADS_HEADS=min(heads, 32 // (head_dim // 8)), QUERY_TILES=query_tiles,
        QUERY_TILES_POW2=1 << (query_tiles - 1).bit_length(), num_warps=tiles.num_warps)
    return delta, lse_log2, semaphores


def launch(q, k, v, grad_attn, attn_output, lse, scale, tiles=FASTEST_TILES, programs=None,
           delta_tiles=DELTA_TILES):
    """grad_qkv [B,S,3E] = dQ | dK | dV in q's dtype (a QKV projection's layout: head
    h's columns at h * D, E + h * D, 2E + h * D): the attention core's backward
    (module docstring), bitwise the same on every call and for any grid. A persistent
    configuration runs `programs` programs (default: one per SM) as a cooperative launch:
    its programs wait on each other's dQ adds, so all must be resident at once, which
    CUDA then guarantees or refuses the launch. delta_tiles: the delta kernel's
    (launch_delta). Everything the main kernel takes is made before the delta kernel is
    launched, so that the two launches follow each other with no host work between."""
    from .kernels.attention_bwd_ws import attention_bwd_ws_kernel
    _check(q, k, v, grad_attn, attn_output, lse, tiles)
    heads_in_rows = _heads_in_rows(q)
    batch, heads, seq_len, head_dim = q.shape
    key_blocks = -(-seq_len // tiles.block_n)                   # per head
    num_items = key_blocks * batch * heads                      # (head, key block) pairs
    sm_count = (torch.cuda.get_device_properties(q.device).multi_processor_count
                if tiles.persistent else None)
    grid = (program_count(tiles, num_items, sm_count, programs, key_blocks),)
    # float32 dQ sums, one [BM,D] tile per (head, query tile), padded past S
    query_tiles = -(-seq_len // tiles.block_m)
    grad_q_sums = buffers.output_buffer(q, batch * heads * query_tiles * tiles.block_m,
                                        head_dim, dtype=torch.float32)
    grad_qkv = buffers.output_buffer(q, batch, seq_len, 3 * heads * head_dim)
    descriptors = (_descriptor(q, heads_in_rows, tiles.block_m, head_dim),
                   _descriptor(k, heads_in_rows, tiles.block_n, head_dim),
                   _descriptor(v, heads_in_rows, tiles.block_n, head_dim),
                   _descriptor(grad_attn, False, tiles.block_m, head_dim))
    sum_descriptor = _sum_descriptor(grad_q_sums, tiles)
    constexprs = kernel_constexprs(heads, seq_len, head_dim, tiles, heads_in_rows)
    delta, lse_log2, semaphores = launch_delta(grad_attn, attn_output, lse, heads,
                                               tiles.block_m, delta_tiles)
    launcher.launch(
        attention_bwd_ws_kernel, grid, *descriptors, lse_log2, delta, sum_descriptor,
        semaphores, grad_qkv, scale, num_items, **constexprs, maxnreg=tiles.maxnreg,
        launch_cooperative_grid=tiles.persistent)
    return grad_qkv


def kernel_constexprs(num_heads, seq_len, head_dim, tiles, heads_in_rows):
    return dict(NUM_HEADS=num_heads, SEQ_LEN=seq_len, HEAD_DIM=head_dim,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, NUM_STAGES=tiles.num_stages,
                HEADS_IN_ROWS=heads_in_rows, WORKER_REGISTERS=tiles.worker_registers,
                GRAD_Q_BUFFERS=tiles.grad_q_buffers, ROTATED_WALK=tiles.rotated_walk,
                DEFERRED_GRAD_Q=tiles.deferred_grad_q,
                num_warps=tiles.num_warps)


_ELEMENT_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}     # triton's names


def _descriptor_type(rows, head_dim, dtype):
    """The signature type of a TMA descriptor of [rows, head_dim] tiles of `dtype` (what
    _descriptor makes), for a compile without a launch."""
    layout = _shared_layout((rows, head_dim), _gl_dtype(dtype))
    return f"tensordesc<{_ELEMENT_TYPES[dtype]}[{rows}, {head_dim}],{layout!r}>"


def compile_sm90(tiles, seq_len=577, num_heads=16, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                 heads_in_rows=False):
    """The main kernel compiled for sm_90 (triton's CompiledKernel: .asm["cubin"],
    .asm["ptx"], .metadata.shared), as `launch` would run it, launching nothing."""
    from .kernels.attention_bwd_ws import attention_bwd_ws_kernel
    from .kernels.gluon_compat import compile_without_launch
    kernel = attention_bwd_ws_kernel
    constexprs = kernel_constexprs(num_heads, seq_len, head_dim, tiles, heads_in_rows)
    element = _ELEMENT_TYPES[dtype]

    def descriptor(rows):
        return _descriptor_type(rows, head_dim, dtype)
    signature = dict(q_desc=descriptor(tiles.block_m), k_desc=descriptor(tiles.block_n),
                     v_desc=descriptor(tiles.block_n),
                     grad_attn_desc=descriptor(tiles.block_m), LSE_LOG2="*fp32",
                     DELTA="*fp32",
                     grad_q_sum_desc=(f"tensordesc<fp32[{tiles.block_m}, {head_dim}],"
                                      f"{_sum_layout(tiles)!r}>"),
                     SEMAPHORES="*i32", GRAD_QKV=f"*{element}", scale="fp32",
                     num_items="i32")
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in kernel.arg_names}
    return compile_without_launch(kernel, signature, constexprs, 90,
                                  num_warps=tiles.num_warps, maxnreg=tiles.maxnreg)


@functools.cache
def compile_failure():
    """None where the main kernel compiles for sm_90 at FASTEST_TILES with the installed
    triton, else why not, in one line; and then, once per process, a RuntimeWarning
    naming the triton. It uses more of Gluon than the two-pass kernels that
    softmax_bwd_gluon.compile_failure probes (warp_specialize, setmaxnreg, mbarriers, the TMA
    add), so a triton may compile those and not this one."""
    return compile_probe.compile_failure(
        lambda: compile_sm90(FASTEST_TILES),
        "the warp-specialized attention backward's kernels for sm_90",
        "the stock ops keep SDPA's own attention backward (under "
        "torch.use_deterministic_algorithms(True), its deterministic one)")
