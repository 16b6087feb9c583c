"""The attention core of the backward as two custom operators, softmax_bwd_rows (dQ and
delta) and softmax_bwd_cols (dK and dV), in the formats their consumers read (shapes
and formats in softmax_bwd_rows' docstring), with their eager launchers.

Exactly one of probs, the attention matrix P [B,H,S,S] (the benchmark contract gives
it), and lse, its row log-sum-exp [B,H,S] (VisionAttentionBlock saves only that), is
given: with lse every P tile is recomputed from q and k, and attn_output O = P v gives
delta = rowsum(dO * O). The
`products` argument (precision.Products' value) names the products: bf16x3 of float32
operands, fp16x3 on their scaled fp16 halves with operand_scales (precision "highest"),
one product of bf16 / fp16 operands.
Each operator also writes partial sums over rows of its gradients, which the graph adds
in a fixed order into the QKV bias gradient.

Eagerly they run the Triton kernels (kernels/softmax_bwd.py) on CUDA and under
TRITON_INTERPRET=1, on bf16 hi/lo operands (head dims: multiples of 8 up to 128,
`kernel_head_dim`); elsewhere PyTorch math in float64, rounded to the same formats.
Under torch.compile on CUDA, vitattn_bwd.inductor lowers them to templates that
max-autotune tunes. `attention_backward_math` is the core in plain PyTorch (the graph's
CPU path); `attention_backward` runs the operators eagerly and returns float32
gradients (tests).
"""
import os
from typing import NamedTuple, Optional

import torch

from . import buffers
from .layout import merge_heads, split_heads
from .precision import (FP16_TOP_EXPONENT, HALF_DTYPES, Products, exponents_of,
                        fp16_scale, power_of_two_scale, powers_of_two,
                        split_bf16_rounded, split_bf16_truncated)
from .validation import check_probs_or_lse


class TileConfig(NamedTuple):
    """One launch configuration of an attention kernel: BLOCK_M query rows and BLOCK_N
    keys per tile (the backward's rows pass and the forward sweep keys BLOCK_N at a time
    for BLOCK_M rows per program; the cols pass the other way round)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# The partial sums over rows of grad_q_sums / grad_kv_sums are per group of this many
# rows: the smallest block of rows a kernel program owns. A program owning several
# groups writes its sum into the first and zeros into the others.
COLUMN_SUM_ROWS = 16


def sum_groups(seq_len):
    """The number of partial sums over rows per batch element: cdiv(S, COLUMN_SUM_ROWS)."""
    return -(-seq_len // COLUMN_SUM_ROWS)


def column_sums(grad):
    """float [B,S,N] -> float32 [B,G,N]: sums over each COLUMN_SUM_ROWS rows (a valid
    filling of the kernels' partial sums: their totals over G are the same)."""
    B, S, N = grad.shape
    padded = torch.nn.functional.pad(grad, (0, 0, 0, sum_groups(S) * COLUMN_SUM_ROWS - S))
    return padded.view(B, sum_groups(S), COLUMN_SUM_ROWS, N).sum(2).float()


# The head dims the kernels take: every multiple of KERNEL_HEAD_DIM_STEP up to
# MAX_KERNEL_HEAD_DIM. A kernel's [.., D] tiles are head_tile(D) wide, the columns past D
# zero-filled on load and masked on store (kernels/softmax_bwd.py); 8 keeps every row of
# a head 16-byte aligned in bf16.
KERNEL_HEAD_DIM_STEP = 8
MAX_KERNEL_HEAD_DIM = 128


def kernel_head_dim(head_dim):
    """Whether the attention kernels (Triton and Gluon) take head_dim."""
    return 0 < head_dim <= MAX_KERNEL_HEAD_DIM and head_dim % KERNEL_HEAD_DIM_STEP == 0


def head_tile(head_dim):
    """The width of the kernels' [.., head_dim] tiles: the next power of two, at least 16
    (kernels/softmax_bwd.py's padded_head_dim)."""
    return max(16, 1 << (head_dim - 1).bit_length())


# Tiles of the eager launch per head tile (the compiled path autotunes its own,
# inductor.py). The pipelined bf16 hi/lo tiles of a 128-wide head tile need smaller
# blocks to fit the 227 KB of shared memory of an H100/H200.
EAGER_TILES = {16: TileConfig(64, 64, 4, 2), 32: TileConfig(64, 64, 4, 2),
               64: TileConfig(64, 64, 4, 2), 128: TileConfig(32, 32, 4, 2)}


def probabilities(q, k, scale, *, probs=None, lse=None):
    """P [B,H,S,S]: probs itself, or recomputed from its log-sum-exp lse [B,H,S]."""
    if lse is None:
        return probs
    return torch.exp((q @ k.transpose(-1, -2)) * scale - lse.unsqueeze(-1))


def attention_backward_math(grad_attn, q, k, v, scale, *, probs=None, lse=None,
                            attn_output=None):
    """The attention core in PyTorch ops, in the inputs' dtype (materializes S x S):
    grad_q, grad_k, grad_v [B,S,E], from P (probs) or its log-sum-exp (lse).
    attn_output (with lse only) gives delta."""
    return _backward_math_and_delta(grad_attn, q, k, v, scale, probs, lse,
                                    attn_output)[:3]


def _backward_math_and_delta(grad_attn, q, k, v, scale, probs, lse, attn_output):
    """attention_backward_math's gradients and the delta [B,H,S,1] they used."""
    probs = probabilities(q, k, scale, probs=probs, lse=lse)               # [B,H,S,S]
    grad_attn = split_heads(grad_attn, probs.shape[1])                     # [B,H,S,D]
    grad_p = grad_attn @ v.transpose(-1, -2)                               # [B,H,S,S]
    delta = _delta(probs, grad_p, grad_attn, attn_output)                  # [B,H,S,1]
    grad_s = probs * (grad_p - delta)
    return (merge_heads(grad_s @ k * scale), merge_heads(grad_s.transpose(-1, -2) @ q * scale),
            merge_heads(probs.transpose(-1, -2) @ grad_attn), delta)


def _delta(probs, grad_p, grad_attn, attn_output):
    """rowsum(P * dP) [B,H,S,1], as the rows pass gets it: from the forward's output
    (rowsum(dO * O)) where one is given, else from P and dP."""
    if attn_output is None:
        return (probs * grad_p).sum(-1, keepdim=True)
    attn_output = split_heads(attn_output, probs.shape[1])                 # [B,H,S,D]
    return (grad_attn * attn_output).sum(-1, keepdim=True)


def _halves(grads, products):
    """float [.., N] tensors -> bf16 [.., 2N]: all hi parts, then all lo parts (rounded
    split, as the kernels store them), for bf16x3; [.., 0] for other products."""
    if products is not Products.BF16X3:
        return grads[0].new_empty(*grads[0].shape[:-1], 0, dtype=torch.bfloat16)
    pairs = [split_bf16_rounded(g.float()) for g in grads]
    return torch.cat([hi for hi, _ in pairs] + [lo for _, lo in pairs], dim=-1)


def triton_supports(device_type, dtype, head_dim):
    """The Triton kernels (eager) and templates (compiled) take float32 CUDA tensors
    with a head_dim the kernels take (kernel_head_dim: multiples of 8 up to 128)."""
    return device_type == "cuda" and dtype == torch.float32 and kernel_head_dim(head_dim)


def _use_triton(t):
    """Eagerly: the kernels where they apply, and CPU tensors under Triton's interpreter."""
    interpreted = t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return triton_supports("cuda" if interpreted else t.device.type, t.dtype, t.shape[-1])


def _tiles(head_dim, block_m, block_n):
    tiles = EAGER_TILES[head_tile(head_dim)]
    return tiles._replace(block_m=block_m or tiles.block_m, block_n=block_n or tiles.block_n)


def check_rows_inputs(probs, lse, attn_output):
    """The rows pass's P or lse (validation.check_probs_or_lse), and with lse the
    forward's output (ValueError); returns whether P is recomputed from lse."""
    recompute_p = check_probs_or_lse("softmax_bwd_rows", probs, lse)
    if recompute_p and attn_output is None:
        raise ValueError("softmax_bwd_rows: with lse, attn_output (the forward's O = P v "
                         "[B,S,E]) must be given, got None")
    return recompute_p


def probs_and_lse_pointers(probs, lse):
    """The kernels' PROBS and LSE arguments (Triton's and Gluon's) for the one of probs
    and lse given: it, contiguous, in both places (a kernel reads the one its
    RECOMPUTE_P names; the other needs a real pointer)."""
    given = (probs if lse is None else lse).contiguous()
    return given, given


def launch_rows(grad_attn, q, k, v, attn_output, scale, *, probs=None, lse=None,
                block_m=None, block_n=None):
    """Run the rows kernel on any tensors Triton can reach, from P (probs) or its
    log-sum-exp (lse, with attn_output); returns the operator's outputs."""
    from .kernels.softmax_bwd import softmax_bwd_rows_kernel
    recompute_p = check_rows_inputs(probs, lse, attn_output)
    B, H, S, D = k.shape
    tiles = _tiles(D, block_m, block_n)
    grad_q16 = buffers.output_buffer(k, B, S, H * D, dtype=torch.float16)
    grad_q_halves = buffers.output_buffer(k, B, S, 2 * H * D, dtype=torch.bfloat16)
    delta = buffers.output_buffer(k, B, H, S)
    grad_q_sums = buffers.output_buffer(k, B, sum_groups(S), H * D)
    grid = (-(-S // tiles.block_m) * B * H,)              # kernels.program_block
    attn_output = probs if attn_output is None else attn_output.contiguous()  # unread if P
    softmax_bwd_rows_kernel[grid](
        *probs_and_lse_pointers(probs, lse), *_kernel_operands(grad_attn, q, k, v),
        attn_output, grad_q16, grad_q_halves, delta, grad_q_sums, scale, SEQ_LEN=S,
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        RECOMPUTE_P=recompute_p,
        SUM_ROWS=COLUMN_SUM_ROWS, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return grad_q16, grad_q_halves, delta, grad_q_sums


def launch_cols(grad_attn, q, k, v, delta, scale, *, probs=None, lse=None, block_m=None,
                block_n=None):
    """Run the cols kernel (see launch_rows)."""
    from .kernels.softmax_bwd import softmax_bwd_cols_kernel
    recompute_p = check_probs_or_lse("softmax_bwd_cols", probs, lse)
    B, H, S, D = q.shape
    tiles = _tiles(D, block_m, block_n)
    grad_kv16 = buffers.output_buffer(q, B, S, 2 * H * D, dtype=torch.float16)
    grad_kv_halves = buffers.output_buffer(q, B, S, 4 * H * D, dtype=torch.bfloat16)
    grad_kv_sums = buffers.output_buffer(q, B, sum_groups(S), 2 * H * D)
    grid = (-(-S // tiles.block_n) * B * H,)
    softmax_bwd_cols_kernel[grid](
        *probs_and_lse_pointers(probs, lse), *_kernel_operands(grad_attn, q, k, v),
        delta.contiguous(), grad_kv16, grad_kv_halves, grad_kv_sums, scale, SEQ_LEN=S,
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        RECOMPUTE_P=recompute_p,
        SUM_ROWS=COLUMN_SUM_ROWS, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return grad_kv16, grad_kv_halves, grad_kv_sums


def _kernel_operands(grad_attn, q, k, v):
    """The bf16 (hi, lo) pairs the kernels read, in their argument order."""
    return [part for t in (grad_attn, q, k, v) for part in split_bf16_truncated(t.contiguous())]


# The Gluon fp16x3 kernels (kernels/softmax_bwd_gluon.py) multiply the scales together
# (s_do * s_v, s_q * s_k, s_ds * s_do * s_v * s_q or s_k, P_SCALE = 2^14 times s_do) and
# divide by those products: each is kept at most 2^MAX_SCALES_EXPONENT.
MAX_SCALES_EXPONENT = 126


def _pair_within(a, b, bound):
    """Exponents a, b with a + b at most `bound`, the larger lowered by the excess."""
    excess = (a + b - bound).clamp_min(0)
    return torch.where(a >= b, a - excess, a), torch.where(a >= b, b, b - excess)


def fp16_operand_scales(grad_attn, q, k, v):
    """The operand_scales of the fp16 halves, float32 [5]: s_do, s_q, s_k, s_v (each
    tensor's fp16_scale) and s_ds, the power of two that brings 2 * max_i |dO_i| *
    max_j |v_j| (norms of rows of one head, in the scaled units) into [2^13, 2^14):
    |dS| <= |dP| + |delta| <= that bound (P <= 1, rows of P summing to 1), so dS * s_ds
    stays below 2^14. The norms are of the scaled rows, the finite ones only: a row
    holding an inf or NaN gives non-finite dS wherever it reaches, as in unscaled math,
    and is left out of the bound that scales every other dS.

    The kernels' products of scales stay within 2^MAX_SCALES_EXPONENT: a tensor of
    zeros (fp16_scale 2^127: an all-zero dO, from a loss term times 0, made s_do * s_v
    inf, the cols pass's delta 0 * inf, and every gradient NaN), or of nothing above
    2^-113, takes scale 1; where a pair's product would still pass the bound, the larger
    scale is lowered (its tensor's fp16 halves then hold fewer bits), and s_ds last.
    For tensors of ordinary magnitude nothing is lowered."""
    scales = torch.stack([fp16_scale(t) for t in (grad_attn, q, k, v)])       # [4]
    exponents = exponents_of(scales)
    exponents = torch.where(exponents == 127, 0, exponents)         # zeros: any scale
    do_e, q_e, k_e, v_e = exponents.unbind()
    do_e = do_e.clamp_max(MAX_SCALES_EXPONENT - 14)                          # P_SCALE * s_do
    do_e, v_e = _pair_within(do_e, v_e, MAX_SCALES_EXPONENT)
    q_e, k_e = _pair_within(q_e, k_e, MAX_SCALES_EXPONENT)
    do_s, v_s = powers_of_two(do_e), powers_of_two(v_e)
    head_dim = q.shape[-1]
    row_norm = lambda t, scale: torch.linalg.vector_norm(                   # noqa: E731
        (t * scale).reshape(-1, head_dim), dim=-1).nan_to_num(nan=0.0, posinf=0.0).amax()
    bound = 2 * row_norm(grad_attn, do_s) * row_norm(v, v_s)
    ds_e = exponents_of(power_of_two_scale(bound, FP16_TOP_EXPONENT - 1))
    ds_e = torch.where(ds_e == 127, 0, ds_e)                                 # dS all zero
    ds_e = torch.minimum(ds_e, MAX_SCALES_EXPONENT - (do_e + v_e + torch.maximum(q_e, k_e)))
    return powers_of_two(torch.stack([do_e, q_e, k_e, v_e, ds_e]))


def check_products(q, products, operand_scales):
    """The operators' products (a Products value) for these operands (ValueError
    otherwise): operand_scales, a float32 [5] tensor, given exactly for fp16x3 of
    float32 operands (it selects the fp16 halves, which only float32 operands have);
    one product for bf16 / fp16 operands of its dtype, three for float ones. Returns the
    Products."""
    products = Products(products)
    if products.fp16_halves or operand_scales is not None:
        if (not products.fp16_halves or operand_scales is None or q.dtype != torch.float32
                or operand_scales.dtype != torch.float32
                or tuple(operand_scales.shape) != (5,)):
            got = (None if operand_scales is None
                   else f"{operand_scales.dtype} {tuple(operand_scales.shape)}")
            raise ValueError(f"operand_scales must be a float32 [5] tensor (s_do, s_q, s_k, "
                             f"s_v, s_ds) for float32 operands with products='fp16x3', and "
                             f"only then; got {got} for {q.dtype} operands with "
                             f"products={products.value!r}")
    if products is Products.PLAIN or products.half_dtype not in (None, q.dtype) or (
            products.half_dtype is None and q.dtype in HALF_DTYPES):
        raise ValueError(f"products={products.value!r} does not run {q.dtype} operands")
    return products


def _double(t):
    """t in float64, or None."""
    return None if t is None else t.double()


def _to_fp16_halves_format(halves):
    """An eager bf16x3 launch's halves as the fp16-halves format's (grad, halves): the
    gradient in float32 (hi + lo), no halves."""
    return float32_from_halves(halves), halves[..., :0]


@torch.library.custom_op("vitattn_bwd::softmax_bwd_rows", mutates_args=())
def softmax_bwd_rows(grad_attn: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, attn_output: Optional[torch.Tensor], scale: float,
                     products: str, probs: Optional[torch.Tensor] = None,
                     lse: Optional[torch.Tensor] = None,
                     operand_scales: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> grad_q16 [B,S,E] fp16, grad_q_halves [B,S,2E] bf16 ([hi | lo]), delta [B,H,S],
    grad_q_sums [B,G,E] float32 (G = sum_groups(S): partial sums over COLUMN_SUM_ROWS
    rows each, which sum over G and B to the QKV bias gradient).

    Exactly one of probs (P [B,H,S,S]) and lse (its log-sum-exp [B,H,S], with
    attn_output [B,S,E]; the contract's attn_output is drawn apart from its P, so with P
    it is not used); grad_attn [B,S,E], heads merged; q, k, v [B,H,S,D]. By `products`
    (precision.Products' value, check_products):
    - "bf16x3", float32 operands: every product bf16x3. The fp16 copies feed the QKV
      weight-gradient GEMM, the bf16 halves the bf16x3 QKV input-gradient GEMM
      (graph.py); hi + lo is the gradient to about 16 mantissa bits.
    - "fp16x3", float32 operands with operand_scales (precision "highest";
      `fp16_operand_scales`): float32
      [5], the powers of two (s_do, s_q, s_k, s_v) that bring grad_attn, q, k and v into
      fp16's range (precision.fp16_scale), and s_ds, which brings dS there: every
      product fp16x3 on their scaled fp16 halves, float32-grade (fp16 hi + lo holds 22
      of float32's 24 bits, bf16's 16). grad_q16 is then the float32 gradient,
      unscaled, and the halves empty: the graph splits it with scales of its own.
      Compiled on Hopper the Gluon kernels run it; elsewhere the bf16x3 kernels do, in
      the same formats, at bf16x3's precision.
    - "one_bf16" or "one_fp16", operands of that dtype (autocast, or precision "medium";
      with the log-sum-exp): one
      product per matmul in that dtype with float32 accumulation, as torch's own
      flash-attention backward computes; grad_q16 is then the gradient in that dtype
      (what both QKV GEMMs read) and the halves are empty ([B,S,0])."""
    check_rows_inputs(probs, lse, attn_output)
    products = check_products(k, products, operand_scales)
    if _use_triton(k):
        grad_q16, grad_q_halves, delta, grad_q_sums = launch_rows(
            grad_attn, q, k, v, attn_output, scale, probs=probs, lse=lse)
        if products.fp16_halves:
            grad_q16, grad_q_halves = _to_fp16_halves_format(grad_q_halves)
        return grad_q16, grad_q_halves, delta, grad_q_sums
    grad_q, _, _, delta = _backward_math_and_delta(
        *(_double(t) for t in (grad_attn, q, k, v)), scale,
        *(_double(t) for t in (probs, lse, attn_output)))
    return (grad_q.to(products.gradient_dtype), _halves([grad_q], products),
            delta.squeeze(-1).float(), column_sums(grad_q))


@softmax_bwd_rows.register_fake
def _(grad_attn, q, k, v, attn_output, scale, products, probs=None, lse=None,
      operand_scales=None):
    check_rows_inputs(probs, lse, attn_output)            # at trace time, not in a graph
    products = check_products(k, products, operand_scales)
    B, H, S, D = k.shape
    return (k.new_empty(B, S, H * D, dtype=products.gradient_dtype),
            k.new_empty(B, S, products.halves_width(H * D), dtype=torch.bfloat16),
            k.new_empty(B, H, S, dtype=torch.float32),
            k.new_empty(B, sum_groups(S), H * D, dtype=torch.float32))


@torch.library.custom_op("vitattn_bwd::softmax_bwd_cols", mutates_args=())
def softmax_bwd_cols(grad_attn: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, delta: torch.Tensor, scale: float,
                     products: str, probs: Optional[torch.Tensor] = None,
                     lse: Optional[torch.Tensor] = None,
                     operand_scales: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> grad_kv16 [B,S,2E] fp16 (dK | dV), grad_kv_halves [B,S,4E] bf16
    ([k_hi v_hi | k_lo v_lo]), grad_kv_sums [B,G,2E] float32; delta [B,H,S] from
    softmax_bwd_rows. The arguments and the formats by operand dtype as
    softmax_bwd_rows'."""
    check_probs_or_lse("softmax_bwd_cols", probs, lse)
    products = check_products(q, products, operand_scales)
    if _use_triton(q):
        grad_kv16, grad_kv_halves, grad_kv_sums = launch_cols(
            grad_attn, q, k, v, delta, scale, probs=probs, lse=lse)
        if products.fp16_halves:
            grad_kv16, grad_kv_halves = _to_fp16_halves_format(grad_kv_halves)
        return grad_kv16, grad_kv_halves, grad_kv_sums
    # dK and dV need delta, which the math recomputes from P and dP itself
    _, grad_k, grad_v = attention_backward_math(
        *(_double(t) for t in (grad_attn, q, k, v)), scale, probs=_double(probs),
        lse=_double(lse))
    grad_kv = torch.cat([grad_k, grad_v], dim=-1)                          # [B,S,2E]
    return (grad_kv.to(products.gradient_dtype), _halves([grad_k, grad_v], products),
            column_sums(grad_kv))


@softmax_bwd_cols.register_fake
def _(grad_attn, q, k, v, delta, scale, products, probs=None, lse=None,
      operand_scales=None):
    check_probs_or_lse("softmax_bwd_cols", probs, lse)    # at trace time, not in a graph
    products = check_products(q, products, operand_scales)
    B, H, S, D = q.shape
    return (q.new_empty(B, S, 2 * H * D, dtype=products.gradient_dtype),
            q.new_empty(B, S, products.halves_width(2 * H * D), dtype=torch.bfloat16),
            q.new_empty(B, sum_groups(S), 2 * H * D, dtype=torch.float32))


def float32_from_halves(halves):
    """[.., 2N] bf16 [hi | lo] -> [.., N] float32 hi + lo."""
    hi, lo = halves.float().chunk(2, dim=-1)
    return hi + lo


def attention_backward(grad_attn, q, k, v, scale, *, probs=None, lse=None,
                       attn_output=None, block_m=None, block_n=None):
    """Both operators eagerly (the Triton kernels where they apply, with optional tile
    sizes), as float32 grad_q, grad_k, grad_v [B,S,E] rebuilt from the bf16 halves.
    probs: P [B,H,S,S], or instead lse, its log-sum-exp [B,H,S], with attn_output, O
    [B,S,E]."""
    p_or_lse = dict(probs=probs, lse=lse)
    if _use_triton(q):
        _, grad_q_halves, delta, _ = launch_rows(grad_attn, q, k, v, attn_output, scale,
                                                 **p_or_lse, block_m=block_m,
                                                 block_n=block_n)
        _, grad_kv_halves, _ = launch_cols(grad_attn, q, k, v, delta, scale, **p_or_lse,
                                           block_m=block_m, block_n=block_n)
    else:
        bf16x3 = Products.BF16X3.value
        _, grad_q_halves, delta, _ = softmax_bwd_rows(grad_attn, q, k, v, attn_output,
                                                      scale, bf16x3, **p_or_lse)
        _, grad_kv_halves, _ = softmax_bwd_cols(grad_attn, q, k, v, delta, scale, bf16x3,
                                                **p_or_lse)
    grad_k, grad_v = float32_from_halves(grad_kv_halves).chunk(2, dim=-1)
    return float32_from_halves(grad_q_halves), grad_k, grad_v
