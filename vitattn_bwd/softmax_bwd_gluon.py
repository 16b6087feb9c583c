"""Host side of the Gluon attention core (kernels/softmax_bwd_gluon.py): where it runs,
its launch configurations, and launchers that write into given output buffers (the
kernels launched through launcher.py's cache of compiled kernels).

The launchers take what the Inductor templates take (inductor.py): grad_attn, q, k and v
as bf16 (hi, lo) pairs, the forward's output with the log-sum-exp (else any
placeholder), the output buffers, which they fill, and P (probs) or its log-sum-exp
(lse), one of the two:

    launch_rows(*halves, attn_output, delta, grad_q_halves, grad_q_sums, grad_q16,
                scale, tiles, products, prefetch, operand_scales, probs=, lse=)
        -> delta [B,H,S] float32, grad_q_halves [B,S,2E] bf16, grad_q_sums [B,G,E]
           float32, grad_q16 [B,S,E] fp16
    launch_cols(*halves, delta, grad_kv_halves, grad_kv_sums, grad_kv16, scale,
                tiles, products, prefetch, operand_scales, probs=, lse=)
        -> grad_kv_halves [B,S,4E] bf16, grad_kv_sums [B,G,2E] float32, grad_kv16
           [B,S,2E] fp16

`halves` is (grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo): grad_attn
[B,S,E] with heads merged and contiguous; q, k, v [B,H,S,D], all with one set of
strides and a contiguous last dim: contiguous (the halves the graph splits), or the
head views of the module's QKV projection [B,S,3E] (bf16 / fp16, read where they
lie). `products` (a precision.Products; the operators take its value) is BF16X3 for
the bf16 halves of float32 tensors, or ONE_BF16 / ONE_FP16 for bf16 / fp16 tensors
given as they are (each tensor twice: its lo is never read); with one product
grad_q16 / grad_kv16 are in the operands' dtype and the halves buffers are empty
(softmax_bwd.py). FP16X3 (precision "highest") takes fp16 halves with `operand_scales`
(float32 [5], softmax_bwd.fp16_operand_scales: the powers of two s_do, s_q, s_k, s_v
that grad_attn, q, k and v were scaled by into fp16's range before their split, and
s_ds for dS): grad_q16 / grad_kv16 are then float32 gradients, unscaled, and the halves
buffers empty. max-autotune
weighs these kernels against the Triton templates (inductor.py) on the GPUs where
`available` says they run; for bf16 / fp16 operands, which the templates do not take,
they are the only candidates.
"""
import functools

import torch

from . import buffers, compile_probe, launcher
from .softmax_bwd import (COLUMN_SUM_ROWS, MAX_KERNEL_HEAD_DIM, TileConfig, head_tile,
                          kernel_head_dim, probs_and_lse_pointers, sum_groups)
from .validation import check_probs_or_lse
from .precision import HALF_DTYPES, Products

# Launch configurations max-autotune times (block_m queries x block_n keys per tile;
# num_warps = 4 per 64 rows the program owns), at head tiles up to 64 wide
# (softmax_bwd.head_tile). Each compiles for sm_90 without spills
# (tests/test_kernel_resources.py). The first of each is what Inductor takes untimed:
# where the inputs are too large to copy for timing (inductor._select), and under
# torch.use_deterministic_algorithms(True), where on the H200 (torch 2.11) the compiled
# graphs ran the first extern choices, cuBLAS for the matmuls and the first Gluon config
# (the one-product cols pass 1.5x slower under the deterministic flag). So the cols
# pass's fastest at batch 32 comes first: 32 x 64 ran 0.358-0.366 ms against 0.543-0.559
# for 64 x 64 in the one-product core and was the fastest with P given too; the rows
# pass's two are within 6% of each other.
ROWS_TILES = (TileConfig(64, 32, 4, 2), TileConfig(64, 64, 4, 2))
COLS_TILES = (TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 2))
# At 128-wide head tiles (head dims 72-128) a [64,128] float32 accumulator takes 64
# registers a thread: the rows pass keeps its 64 x 32 tiles (64 x 64 spilled 428 bytes
# with P given), the cols pass, which holds two, takes 16 queries per tile (64 x 64
# spilled 412 bytes, 32 x 64 24-48 in four of its eight variants). Compiled for sm_90
# at head dim 72 (scripts/kernel_resources.py --head-dim 72): three waits per tile as
# at 64, at most 128 KB of shared memory, no spills but 48 bytes in the cols pass of
# bf16x3 with P given (the contract's mode, whose head dim is 64). At head dim 128
# (no masks) the register allocation differs: the float32 cols pass spills 124 bytes
# with P given, 112 with P recomputed (bf16, fp16 and fp16-halves variants none); the
# Triton templates' cols tiles it is timed against spill 100-504 bytes there. On the
# H200 at head dims 72 and 80 these tiles ran 3.08 and 0.59 ms (float32 "high", P
# given, batch 32) against the Triton kernels' 8.86 and 2.39, and a SigLIP-shaped
# tower's autotuning chose them; 104 and 128 are not timed.
WIDE_ROWS_TILES = (TileConfig(64, 32, 4, 2),)
WIDE_COLS_TILES = (TileConfig(16, 64, 4, 3),)
# The (batch, head) rows of a launch's grid: CUDA caps its second dimension at 65,535.
# The Triton kernels take a 1-D grid instead; here a block index from `%` on one tripped
# triton 3.6's Gluon lowering (an LLVM assertion at sequence length 33).
MAX_GRID_ROWS = 65535
# Every multiple of 8 up to 128 (softmax_bwd.kernel_head_dim): the kernels pad their
# tiles to head_tile(head_dim) columns. Checked against float64 on the H200 at 64, 72
# and 80.
HEAD_DIMS = tuple(d for d in range(1, MAX_KERNEL_HEAD_DIM + 1) if kernel_head_dim(d))


def rows_tiles(head_dim):
    """The rows pass's launch configurations at head_dim."""
    return ROWS_TILES if head_tile(head_dim) <= 64 else WIDE_ROWS_TILES


def cols_tiles(head_dim):
    """The cols pass's launch configurations at head_dim."""
    return COLS_TILES if head_tile(head_dim) <= 64 else WIDE_COLS_TILES
# How many P tiles ahead of its register loads a program asks the L2 for them (the
# kernels' prefetch_to_l2; 0: not at all). At batch 32 on the H200 the cols pass at
# 32 x 64 tiles ran 0.774-0.775 ms without, 0.661-0.680 at 2 ahead. The rows pass showed
# no gain beyond its run-to-run spread: 0.593 / 0.603 without, 0.546 / 0.603 at 4 ahead
# (two machines), 0.588-0.621 at 64 x 64 tiles either way; 4 is what the committed runs
# used.
ROWS_PREFETCH = 4
COLS_PREFETCH = 2


def available(device, dtype, head_dim):
    """The Gluon kernels run on Hopper (compute capability 9.x) CUDA devices, for
    float32, bfloat16 and float16 inputs and the head dims in HEAD_DIMS (multiples of 8
    up to 128), with a Triton whose Gluon compiles them (compile_failure). The head dim is
    compared outside `_runs_on`: under torch.compile(dynamic=True) it is symbolic, which
    torch 2.11 cannot pass to a constant-result function."""
    return head_dim in HEAD_DIMS and _runs_on(device, dtype)


@torch.compiler.assume_constant_result
def _runs_on(device, dtype):
    """available's device and dtype part: constant for a process, so torch.compile reads
    it once when tracing."""
    if device.type != "cuda" or dtype not in (torch.float32, *HALF_DTYPES):
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return major == 9 and compile_failure(10 * major + minor) is None


@functools.cache
def compile_failure(arch):
    """None where both kernels compile for compute capability `arch` (90 for sm_90) with
    the installed triton, else why not, in one line; and then, once per process, a
    RuntimeWarning naming the triton, after which the attention core runs on the Triton
    templates and precision "medium" runs "high". Decided by compiling each
    kernel once (about a second each, cached by triton on disk: little next to the
    autotuning that follows), because Gluon's API moves between triton releases and a
    kernel file that imports may still not compile."""
    return compile_probe.compile_failure(
        lambda: _compile_probe(arch), f"the Gluon kernels for sm_{arch}",
        "the attention core runs on the Triton templates, and precision 'medium' runs "
        "'high'")


def _compile_probe(arch):
    """Compile the rows and cols kernels (P given, three products of bf16 halves: the
    variant that uses every Gluon feature the family has) at ViT-L/14-336's shape and
    their first configured tiles for `arch`, launching nothing."""
    from .kernels import gluon_compat, softmax_bwd_gluon as kernels
    if gluon_compat.MISSING:
        raise ImportError(f"this Gluon lacks {', '.join(gluon_compat.MISSING)}")
    seq_len, num_heads, head_dim = 577, 16, 64
    strides = (num_heads * seq_len * head_dim, seq_len * head_dim, head_dim)
    for kernel, tiles, prefetch in (
            (kernels.softmax_bwd_rows_kernel, ROWS_TILES[0], ROWS_PREFETCH),
            (kernels.softmax_bwd_cols_kernel, COLS_TILES[0], COLS_PREFETCH)):
        constexprs = kernel_constexprs(seq_len, num_heads, head_dim, strides, tiles,
                                       recompute_p=False, products=Products.BF16X3,
                                       prefetch=prefetch)
        gluon_compat.compile_without_launch(kernel, _probe_signature(kernel, constexprs),
                                            constexprs, arch, num_warps=tiles.num_warps)


def _probe_signature(kernel, constexprs):
    """The argument types of a launch on float32 tensors, by name: bf16 operand halves
    (*_HI, *_LO) and gradient halves (*_HALVES), fp16 gradients (*16), float32 other
    tensors, a float32 `scale`."""
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name == "scale":
            return "fp32"
        if name.endswith(("_HI", "_LO", "_HALVES")):
            return "*bf16"
        return "*fp16" if name.endswith("16") else "*fp32"
    return {name: kind(name) for name in kernel.arg_names}


@functools.cache
def _operand_smem_layout(head_dim):
    """The shared-memory layout of the kernels' [rows, head_tile(head_dim)] operand
    tiles."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for([64, head_tile(head_dim)], gl.bfloat16)


def _qkv_strides(*qkv_parts):
    """The (batch, head, row) element strides the kernels address q, k, v by: one set
    for every part, with a contiguous last dim (ValueError otherwise)."""
    strides = {t.stride() for t in qkv_parts}
    if len(strides) != 1 or qkv_parts[0].stride(-1) != 1:
        raise ValueError(f"q, k, v (and their halves) must share strides with a "
                         f"contiguous last dim, got {sorted(strides)}")
    return qkv_parts[0].stride()[:3]


def kernel_constexprs(seq_len, num_heads, head_dim, qkv_strides, tiles, recompute_p,
                      products, prefetch):
    """The kernels' constexpr arguments: the shape, the (batch, head, row) element
    strides of q, k, v, the tiles and the mode (PRODUCTS: products' count per matmul)."""
    batch_stride, head_stride, row_stride = qkv_strides
    return dict(SEQ_LEN=seq_len, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, NUM_STAGES=tiles.num_stages,
                RECOMPUTE_P=recompute_p, PRODUCTS=products.count, PREFETCH=prefetch,
                SUM_ROWS=COLUMN_SUM_ROWS, OPERAND_SMEM=_operand_smem_layout(head_dim),
                QKV_BATCH_STRIDE=batch_stride, QKV_HEAD_STRIDE=head_stride,
                QKV_ROW_STRIDE=row_stride, num_warps=tiles.num_warps)


def _constexprs(qkv_parts, tiles, recompute_p, products, prefetch):
    _, num_heads, seq_len, head_dim = qkv_parts[0].shape
    return kernel_constexprs(seq_len, num_heads, head_dim, _qkv_strides(*qkv_parts), tiles,
                             recompute_p, products, prefetch)


def _check_operand_scales(operand_scales, grad_attn_hi, products):
    """operand_scales is given exactly for fp16x3 (ValueError otherwise); the kernels
    read it there, and any real pointer elsewhere (_launch)."""
    if products.fp16_halves != (operand_scales is not None):
        raise ValueError(f"operand_scales must be given for fp16x3 (fp16 halves) and only "
                         f"then; got products={products.value!r}, operand "
                         f"dtype {grad_attn_hi.dtype}, operand_scales "
                         f"{'given' if operand_scales is not None else 'None'}")


def _launch(kernel, rows_per_program, probs, halves, pass_args, scale, tiles,
            recompute_p, products, prefetch, operand_scales):
    """Launch a pass's kernel: one program per rows_per_program rows of each (batch,
    head), given the PROBS pointer, the operand halves (grad_attn, q, k, v; hi, lo
    each), pass_args (the LSE pointer and the pass's other buffers, in the kernel's
    order), scale, the constexprs and operand_scales (fp16x3's; SCALES is any real
    pointer elsewhere: _check_operand_scales). Every tensor but operand_scales has the
    batch first, so a batch past MAX_GRID_ROWS // heads launches in chunks of whole
    images, each program's work unchanged."""
    qkv_halves = halves[2:]
    _check_operand_scales(operand_scales, halves[0], products)
    batch, num_heads, seq_len, _ = qkv_halves[0].shape
    constexprs = _constexprs(qkv_halves, tiles, recompute_p, products, prefetch)
    chunk = max(1, MAX_GRID_ROWS // num_heads)
    for start in range(0, batch, chunk):
        images = slice(start, start + chunk)
        chunk_halves = [t[images] for t in halves]
        scales = chunk_halves[0] if operand_scales is None else operand_scales  # any pointer
        grid = (-(-seq_len // rows_per_program), min(chunk, batch - start) * num_heads)
        launcher.launch(kernel, grid, probs[images], *chunk_halves, scales,
                        *(t[images] for t in pass_args), scale, **constexprs)


def _written_or_any(halves, any_buffer):
    """A halves buffer, or where it is empty (no halves: never written) any real
    pointer."""
    return halves if halves.numel() else any_buffer


def launch_rows(grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                attn_output, delta, grad_q_halves, grad_q_sums, grad_q16, scale, tiles,
                products=Products.BF16X3, prefetch=ROWS_PREFETCH, operand_scales=None, *,
                probs=None, lse=None):
    from .kernels.softmax_bwd_gluon import softmax_bwd_rows_kernel
    recompute_p = check_probs_or_lse("softmax_bwd_gluon.launch_rows", probs, lse)
    probs, lse = probs_and_lse_pointers(probs, lse)
    _launch(softmax_bwd_rows_kernel, tiles.block_m, probs,
            (grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo),
            (lse, attn_output, grad_q16, _written_or_any(grad_q_halves, grad_q_sums),
             delta, grad_q_sums), scale, tiles, recompute_p, products, prefetch,
            operand_scales)


def launch_cols(grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                delta, grad_kv_halves, grad_kv_sums, grad_kv16, scale, tiles,
                products=Products.BF16X3, prefetch=COLS_PREFETCH, operand_scales=None, *,
                probs=None, lse=None):
    from .kernels.softmax_bwd_gluon import softmax_bwd_cols_kernel
    recompute_p = check_probs_or_lse("softmax_bwd_gluon.launch_cols", probs, lse)
    probs, lse = probs_and_lse_pointers(probs, lse)
    _launch(softmax_bwd_cols_kernel, tiles.block_n, probs,
            (grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo),
            (lse, delta, grad_kv16, _written_or_any(grad_kv_halves, grad_kv_sums),
             grad_kv_sums), scale, tiles, recompute_p, products, prefetch, operand_scales)


# ---- what the compiled graph calls when max-autotune picks a Gluon kernel ------------
# The benchmark callables fill given buffers (the inputs and `out` of an Inductor
# extern choice); the operators return new tensors, so that Inductor sees every output
# of the kernel as an output of the node it schedules (inductor.py).

def _given(probs, lse, recompute_p):
    """probs= and lse= for the launchers from an Inductor choice's two inputs, both real
    tensors (the unread one a placeholder): the one recompute_p names."""
    return dict(probs=None, lse=lse) if recompute_p else dict(probs=probs, lse=None)


def rows_out(probs, lse, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
             attn_output, delta, grad_q_halves, grad_q_sums, operand_scales=None, *, out,
             scale, block_m, block_n, num_warps, num_stages, products, recompute_p):
    launch_rows(grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                attn_output, delta, grad_q_halves, grad_q_sums, out, scale,
                TileConfig(block_m, block_n, num_warps, num_stages), Products(products),
                operand_scales=operand_scales, **_given(probs, lse, recompute_p))


def cols_out(probs, lse, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
             delta, grad_kv_halves, grad_kv_sums, operand_scales=None, *, out, scale,
             block_m, block_n, num_warps, num_stages, products, recompute_p):
    launch_cols(grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                delta, grad_kv_halves, grad_kv_sums, out, scale,
                TileConfig(block_m, block_n, num_warps, num_stages), Products(products),
                operand_scales=operand_scales, **_given(probs, lse, recompute_p))


def _new_empty(like, *shape, dtype):
    return like.new_empty(shape, dtype=dtype)


def rows_outputs(q_hi, products, empty=_new_empty):
    """grad_q16, grad_q_halves, delta, grad_q_sums for a Products, each from empty(q_hi,
    *shape, dtype=...): new_empty for the fake implementation, buffers.output_buffer for
    the kernel's."""
    batch, num_heads, seq_len, head_dim = q_hi.shape
    embed_dim = num_heads * head_dim
    return (empty(q_hi, batch, seq_len, embed_dim, dtype=products.gradient_dtype),
            empty(q_hi, batch, seq_len, products.halves_width(embed_dim),
                  dtype=torch.bfloat16),
            empty(q_hi, batch, num_heads, seq_len, dtype=torch.float32),
            empty(q_hi, batch, sum_groups(seq_len), embed_dim, dtype=torch.float32))


def cols_outputs(q_hi, products, empty=_new_empty):
    """grad_kv16, grad_kv_halves, grad_kv_sums (see rows_outputs)."""
    batch, num_heads, seq_len, head_dim = q_hi.shape
    embed_dim = num_heads * head_dim
    return (empty(q_hi, batch, seq_len, 2 * embed_dim, dtype=products.gradient_dtype),
            empty(q_hi, batch, seq_len, products.halves_width(2 * embed_dim),
                  dtype=torch.bfloat16),
            empty(q_hi, batch, sum_groups(seq_len), 2 * embed_dim, dtype=torch.float32))


# The operators are defined through torch.library.Library, not custom_op: the graph calls
# them on every backward, and under cProfile on the H200's host custom_op's wrapper
# (autograd layer, per-call aliasing checks) took 0.22 ms of its own per call
# (scripts/profile_host.py). Their outputs are new tensors and never need a gradient.
_LIBRARY = torch.library.Library("vitattn_bwd", "FRAGMENT")
_OPERANDS = ("Tensor? probs, Tensor? lse, Tensor grad_attn_hi, Tensor grad_attn_lo, "
             "Tensor q_hi, Tensor q_lo, Tensor k_hi, Tensor k_lo, Tensor v_hi, Tensor v_lo")
_TILES = ("float scale, int block_m, int block_n, int num_warps, int num_stages, "
          "str products, Tensor? operand_scales=None")
_LIBRARY.define(f"gluon_softmax_bwd_rows({_OPERANDS}, Tensor attn_output, {_TILES}) "
                "-> (Tensor, Tensor, Tensor, Tensor)")
_LIBRARY.define(f"gluon_softmax_bwd_cols({_OPERANDS}, Tensor delta, {_TILES}) "
                "-> (Tensor, Tensor, Tensor)")


def gluon_softmax_bwd_rows(probs, lse, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo,
                           v_hi, v_lo, attn_output, scale, block_m, block_n, num_warps,
                           num_stages, products, operand_scales=None):
    """The rows pass on pre-split operands, from P (probs) or its log-sum-exp (lse), the
    other None -> grad_q16, grad_q_halves, delta, grad_q_sums; products: a Products'
    value."""
    products = Products(products)
    grad_q16, grad_q_halves, delta, grad_q_sums = rows_outputs(q_hi, products,
                                                                buffers.output_buffer)
    launch_rows(grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                attn_output, delta, grad_q_halves, grad_q_sums, grad_q16, scale,
                TileConfig(block_m, block_n, num_warps, num_stages), products,
                operand_scales=operand_scales, probs=probs, lse=lse)
    return grad_q16, grad_q_halves, delta, grad_q_sums


def gluon_softmax_bwd_cols(probs, lse, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo,
                           v_hi, v_lo, delta, scale, block_m, block_n, num_warps,
                           num_stages, products, operand_scales=None):
    """The cols pass on pre-split operands (probs or lse as the rows pass's) ->
    grad_kv16, grad_kv_halves, grad_kv_sums."""
    products = Products(products)
    grad_kv16, grad_kv_halves, grad_kv_sums = cols_outputs(q_hi, products,
                                                            buffers.output_buffer)
    launch_cols(grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                delta, grad_kv_halves, grad_kv_sums, grad_kv16, scale,
                TileConfig(block_m, block_n, num_warps, num_stages), products,
                operand_scales=operand_scales, probs=probs, lse=lse)
    return grad_kv16, grad_kv_halves, grad_kv_sums


_LIBRARY.impl("gluon_softmax_bwd_rows", gluon_softmax_bwd_rows, "CUDA")
_LIBRARY.impl("gluon_softmax_bwd_cols", gluon_softmax_bwd_cols, "CUDA")


@torch.library.register_fake("vitattn_bwd::gluon_softmax_bwd_rows", lib=_LIBRARY)
def _(probs, lse, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
      attn_output, scale, block_m, block_n, num_warps, num_stages, products,
      operand_scales=None):
    check_probs_or_lse("gluon_softmax_bwd_rows", probs, lse)
    return rows_outputs(q_hi, Products(products))


@torch.library.register_fake("vitattn_bwd::gluon_softmax_bwd_cols", lib=_LIBRARY)
def _(probs, lse, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo, delta,
      scale, block_m, block_n, num_warps, num_stages, products, operand_scales=None):
    check_probs_or_lse("gluon_softmax_bwd_cols", probs, lse)
    return cols_outputs(q_hi, Products(products))
