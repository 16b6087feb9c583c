"""Float32-faithful GEMMs at tensor-core speed (precision "highest"): fp16x3 with
two-level accumulation, as one custom operator and the graph-level helpers around it.

    split_gemm(a_hi, a_lo, b_hi, b_lo, unscale) -> float32 [M,N]
        = (a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi) * unscale[0] * unscale[1]

a_hi, a_lo [M,K] and b_hi, b_lo [K,N] are fp16 halves (22 of float32's 24 mantissa
bits) of float32 operands scaled by powers of two into fp16's range (`fp16_halves`);
unscale, float32 [2], two balanced powers of two whose product is the scales' inverse
(`unscale_of`: the inverse alone can lie outside float32's range), takes them back out
exactly. Any strides: a transposed view of halves is read as it lies (`transposed`).

On CUDA and under TRITON_INTERPRET=1 the operator runs the Triton kernel of
kernels/split_gemm.py, which accumulates each BLOCK_K slice of K on the tensor cores
and adds the slices' partials in float32 registers: the tensor cores' accumulation
truncates, and one accumulator over all of K put cuBLAS fp16x3 GEMMs 5-190x above
float32 SGEMM's error against float64. Under torch.compile on CUDA, inductor.py lowers
it to a Triton template that autotuning tunes. Elsewhere it runs as float32 matmuls of the upcast halves (exact products,
float32 accumulation, rounded to nearest). `matmul_fp16x3` takes a K past K_CHUNK rows
in K_CHUNKS chunks, one operator call each.
"""
import os
from typing import NamedTuple

import torch

from . import buffers
from .precision import exponents_of, fp16_scale, powers_of_two, split_fp16


class GemmTiles(NamedTuple):
    """A launch configuration of the split GEMM kernel."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Offsets of 32 bits reach elements below this; an operand or output spanning more
# elements gets the kernel's 64-bit offsets (kernels/split_gemm.py, OFFSET_DTYPE).
INT32_OFFSET_LIMIT = 2 ** 31


def span(t):
    """The elements from t's first to its last, through its strides (a transposed view
    spans what its rows do)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def offset_dtype(*tensors):
    """tl.int64 where one of the kernel's tensors spans 2^31 elements or more, else
    tl.int32 (what Inductor's INDEX_DTYPE chooses for the template, by the same rule)."""
    import triton.language as tl
    if any(t.numel() and span(t) >= INT32_OFFSET_LIMIT for t in tensors):
        return tl.int64
    return tl.int32


# The eager launch's tiles (the compiled path tunes its own, inductor.py).
EAGER_TILES = GemmTiles(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
GROUP_M = 8


class Fp16Halves(NamedTuple):
    """fp16 hi + lo of a float32 tensor times `scale` (a 0-dim power of two)."""
    hi: torch.Tensor
    lo: torch.Tensor
    scale: torch.Tensor


def fp16_halves(t):
    """float32 t [M,N] -> its Fp16Halves: t scaled so that its largest magnitude lies in
    [2^14, 2^15) (precision.fp16_scale), split by rounding (precision.split_fp16).
    Elements below 2^-28 of the largest keep about 2^-25 of its absolute precision."""
    scale = fp16_scale(t)
    hi, lo = split_fp16(t * scale)
    return Fp16Halves(hi, lo, scale)


def transposed(halves):
    """The halves of t^T, as views."""
    return Fp16Halves(halves.hi.t(), halves.lo.t(), halves.scale)


# A K past K_CHUNK rows (a weight gradient past batch 56 at ViT-L/14-336, K = B*S) is cut
# into K_CHUNKS equal chunks, each one split GEMM call, whose products are added in
# float32. The kernel adds its K slices' partials one after another in one float32
# accumulator, whose rounding grows with their count: at K = 2^20 + 2^10 (16,400 slices
# of BLOCK_K 64) it was 5.8x float32 SGEMM's error against float64, in chunks within
# 1.5x, and at the benchmark's K (up to 32,312) below 1.5x. A fixed count, not a fixed length: under torch.compile a dynamic
# batch makes K symbolic, and a loop whose length depended on its value would
# specialize it.
K_CHUNK = 2 ** 15
K_CHUNKS = 32


def matmul_fp16x3(a, b):
    """a @ b -> float32 [M,N] for a [M,K] and b [K,N] given as Fp16Halves; K past K_CHUNK
    in K_CHUNKS chunks, their products added in order (deterministic)."""
    unscale = unscale_of(a, b)
    K = a.hi.shape[1]
    if K <= K_CHUNK:
        return split_gemm(a.hi, a.lo, b.hi, b.lo, unscale)
    # the last chunk takes the rest: at least one row, K > K_CHUNK >= K_CHUNKS^2
    chunk_rows = (K + K_CHUNKS - 1) // K_CHUNKS
    bounds = [chunk * chunk_rows for chunk in range(K_CHUNKS)] + [K]

    def chunk_product(start, end):                                            # [M,N]
        return split_gemm(a.hi[:, start:end], a.lo[:, start:end], b.hi[start:end],
                          b.lo[start:end], unscale)
    product = chunk_product(bounds[0], bounds[1])
    for start, end in zip(bounds[1:-1], bounds[2:]):
        product = product + chunk_product(start, end)
    return product


def unscale_of(a, b):
    """The split GEMM's unscale for Fp16Halves a and b: float32 [2], two powers of two
    whose product is 1 / (a.scale * b.scale), balanced (exponents floor(k / 2) and the
    rest, for the product's exponent k): the kernel multiplies a tile by one, then the
    other, and with the first no nearer the ends of float32's range than the result, no
    partial product overflows where the result does not (1/a.scale, then 1/b.scale,
    took an operand of 2^120's tiles past float32's range on the way to ~2^110).
    The scales are normal float32 powers of two (precision.power_of_two_scale), read off
    their exponent bits: exact, but for two scales of 2^127 (tensors below 2^-113),
    whose product's 2^-254 is taken as 2^-252, where float32's products are 0 anyway."""
    exponent = -exponents_of(torch.stack([a.scale, b.scale])).sum()  # of 1/(a.scale*b.scale)
    first = torch.div(exponent, 2, rounding_mode="floor")
    return powers_of_two(torch.stack([first, exponent - first]).clamp(-126, 127))


def linear_fp16x3(a, weight, bias):
    """F.linear(a, weight, bias) for float32 a [.., K], weight [N,K], bias [N], as
    faithful as float32's: a @ weight^T by split_gemm, the weight read transposed."""
    rows = a.reshape(-1, a.shape[-1])                                        # [M,K]
    out = matmul_fp16x3(fp16_halves(rows), transposed(fp16_halves(weight))) + bias
    return out.view(*a.shape[:-1], weight.shape[0])                          # [..,N]


def _use_triton(t):
    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check(a_hi, a_lo, b_hi, b_lo, unscale):
    """ValueError naming the argument that does not fit."""
    for name, t in (("a_hi", a_hi), ("a_lo", a_lo), ("b_hi", b_hi), ("b_lo", b_lo)):
        if t.dtype != torch.float16 or t.dim() != 2:
            raise ValueError(f"split_gemm: {name} must be a 2-d float16 tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if a_lo.shape != a_hi.shape or b_lo.shape != b_hi.shape:
        raise ValueError(f"split_gemm: a_lo {tuple(a_lo.shape)} / b_lo {tuple(b_lo.shape)} "
                         f"must have the shapes of a_hi {tuple(a_hi.shape)} / b_hi "
                         f"{tuple(b_hi.shape)}")
    if a_hi.shape[1] != b_hi.shape[0]:
        raise ValueError(f"split_gemm: a_hi {tuple(a_hi.shape)} and b_hi "
                         f"{tuple(b_hi.shape)} do not multiply")
    if unscale.dtype != torch.float32 or tuple(unscale.shape) != (2,):
        raise ValueError(f"split_gemm: unscale must be a float32 [2] tensor, got "
                         f"{unscale.dtype} {tuple(unscale.shape)}")


def launch(a_hi, a_lo, b_hi, b_lo, unscale, tiles=EAGER_TILES):
    """Run the kernel on tensors Triton can reach (the halves of each operand sharing
    strides); returns C [M,N] float32."""
    from .kernels.split_gemm import split_gemm_kernel
    if a_lo.stride() != a_hi.stride():
        a_hi, a_lo = a_hi.contiguous(), a_lo.contiguous()
    if b_lo.stride() != b_hi.stride():
        b_hi, b_lo = b_hi.contiguous(), b_lo.contiguous()
    (M, K), N = a_hi.shape, b_hi.shape[1]
    out = buffers.output_buffer(a_hi, M, N, dtype=torch.float32)
    grid = (-(-M // tiles.block_m) * -(-N // tiles.block_n),)
    split_gemm_kernel[grid](a_hi, a_lo, b_hi, b_lo, unscale, out, M, N, K, *a_hi.stride(),
                            *b_hi.stride(), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                            BLOCK_K=tiles.block_k, GROUP_M=GROUP_M,
                            OFFSET_DTYPE=offset_dtype(a_hi, b_hi, out),
                            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


@torch.library.custom_op("vitattn_bwd::split_gemm", mutates_args=())
def split_gemm(a_hi: torch.Tensor, a_lo: torch.Tensor, b_hi: torch.Tensor,
               b_lo: torch.Tensor, unscale: torch.Tensor) -> torch.Tensor:
    _check(a_hi, a_lo, b_hi, b_lo, unscale)
    if _use_triton(a_hi):
        return launch(a_hi, a_lo, b_hi, b_lo, unscale)
    a_hi, a_lo, b_hi, b_lo = (t.float() for t in (a_hi, a_lo, b_hi, b_lo))
    return ((a_lo @ b_hi + a_hi @ b_lo) + a_hi @ b_hi) * unscale[0] * unscale[1]


@split_gemm.register_fake
def _(a_hi, a_lo, b_hi, b_lo, unscale):
    _check(a_hi, a_lo, b_hi, b_lo, unscale)             # at trace time, not in a graph
    return a_hi.new_empty(a_hi.shape[0], b_hi.shape[1], dtype=torch.float32)
