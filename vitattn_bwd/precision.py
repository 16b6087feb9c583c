"""Float32-grade matrix products at tensor-core speed, from operands split once.

"bf16x3": a float32 operand is split into bf16 hi + lo (about 16 of its 24 mantissa
bits), and a @ b ~= a_hi @ b_hi + a_lo @ b_hi + a_hi @ b_lo with float32 accumulation
(relative error ~1e-5). An activation is split once into its "halves", one bf16 tensor
[.., 2N] = [hi | lo] that several GEMMs read as it lies:
    a @ b    =  [a_hi | a_lo] @ [b_hi ; b_hi]  +  a_hi @ b_lo                (two GEMMs)
    a^T @ c  =  ([a_hi | a_lo]^T @ c_hi)  +  a_hi^T @ c_lo   (added small terms first,
                                                        accurate at large K = B*S)
At precision "high" the QKV weight gradient is ONE GEMM of round-to-nearest fp16
operands (unbiased, unlike truncating TF32), as the contract's tolerance allows.

"fp16x3" (precision "highest"): the same three products of fp16 hi + lo (22 of 24
bits), each operand first scaled by a power of two (exact) into fp16's range
(fp16_scale); its GEMMs run as split_gemm.py's, whose two-level accumulation keeps them
within float32's own error where cuBLAS's one accumulator over K does not.

Splits use integer rounding and masking, not casts: Inductor folds a float32 -> bf16 ->
float32 round trip inside a fused kernel (lo == 0), and the GPU contracts Veltkamp's
splitting into an FMA (lo == 0 again). On CUDA the GEMMs are cuBLAS bf16 / fp16 GEMMs
with a float32 result; elsewhere float32 matmuls of the upcast parts, exact for products
of bf16 or fp16 values, so the CPU reproduces the GPU's arithmetic up to summation order.
"""
import enum

import torch

# The precisions of the fused float32 path, PyTorch's names for float32 matmul precision
# (torch.set_float32_matmul_precision): "highest", every product fp16x3 from scaled fp16
# halves (split_gemm.py's GEMMs, the Gluon attention core); "high" the fastest map the
# benchmark's tolerance allows: bf16x3 from truncated splits, one fp16 product for the
# QKV weight gradient (graph.py).
FUSED_PRECISIONS = ("highest", "high")
# The half-precision dtypes: of the one-product path's activations (autocast, "medium"),
# of blocks that are all bf16 or all fp16, and of the Gluon kernels' operands.
HALF_DTYPES = (torch.bfloat16, torch.float16)



class Products(enum.Enum):
    """The products the fused path runs per matmul: decided once (routing.route through
    fused_products; on_device and graph.products_for for where and what the backward
    runs) and carried unchanged from there to the kernels' constexprs. Its value is a
    string, as torch.library schemas take it."""
    PLAIN = "plain"         # the inputs' own dtype, plain matmuls (the CPU, float64)
    ONE_BF16 = "one_bf16"   # one bf16 product per matmul ("medium")
    ONE_FP16 = "one_fp16"   # one fp16 product per matmul ("medium")
    BF16X3 = "bf16x3"       # three products of bf16 halves ("high")
    FP16X3 = "fp16x3"       # three of scaled fp16 halves with operand_scales ("highest")

    @property
    def count(self):
        """Products per matmul: the Gluon kernels' PRODUCTS constexpr."""
        return 1 if self in (Products.ONE_BF16, Products.ONE_FP16) else 3

    @property
    def half_dtype(self):
        """The dtype of the one-product path's activations, else None."""
        return {Products.ONE_BF16: torch.bfloat16,
                Products.ONE_FP16: torch.float16}.get(self)

    @property
    def fp16_halves(self):
        """Whether the attention core's operands are scaled fp16 halves, given with
        their operand_scales."""
        return self is Products.FP16X3

    @property
    def gradient_dtype(self):
        """The dtype of the attention core's grad_q16 / grad_kv16: fp16 for bf16x3 (the
        QKV weight gradient's fp16 product reads it), float32 for fp16x3, the half dtype
        with one product."""
        if self is Products.FP16X3:
            return torch.float32
        return self.half_dtype or torch.float16

    def halves_width(self, width):
        """The width of the attention core's bf16 halves of a `width`-column gradient:
        2 * width for bf16x3, else 0 (no halves)."""
        return 2 * width if self is Products.BF16X3 else 0

    def on_device(self, device_type):
        """These products where they run on `device_type`: three products are plain
        ones off CUDA (float32 or float64 math, as faithful as "highest" asks)."""
        if device_type != "cuda" and self in (Products.BF16X3, Products.FP16X3):
            return Products.PLAIN
        return self

    @property
    def graph_tag(self):
        """What names a compiled graph of these products in the cache tag."""
        if self.half_dtype is not None:
            return f"{str(self.half_dtype).removeprefix('torch.')}-"
        return "highest-" if self is Products.FP16X3 else ""


def fused_products(precision, half_dtype=None):
    """The Products of the fused path: one product in half_dtype where it is given, else
    three for a precision of FUSED_PRECISIONS ("highest": fp16x3, "high": bf16x3)."""
    if half_dtype is not None:
        return Products.ONE_BF16 if half_dtype == torch.bfloat16 else Products.ONE_FP16
    return Products.FP16X3 if precision == "highest" else Products.BF16X3


# float32 bits of the bf16 part of a value: sign, exponent and the top 7 mantissa bits
BF16_HI_MASK = -65536            # 0xFFFF0000 as an int32
BF16_ROUNDING_BIAS = 0x7FFF      # added below the bf16 bits: round half to even


def split_bf16_truncated(t):
    """float32 t -> (hi, lo) bf16: hi = t truncated to bf16, lo = t - hi rounded."""
    hi = (t.view(torch.int32) & BF16_HI_MASK).view(torch.float32)
    return hi.to(torch.bfloat16), (t - hi).to(torch.bfloat16)


def _rounded(t, bias, shift, mask):
    """float32 t rounded to nearest even at bit `shift` by integer operations: `mask`
    keeps the bits above it, `bias` (just under half of bit `shift`) plus its parity
    rounds."""
    bits = t.view(torch.int32)
    return ((bits + bias + ((bits >> shift) & 1)) & mask).view(torch.float32)


def split_bf16_rounded(t):
    """float32 t -> (hi, lo) bf16: hi = t rounded to the nearest bf16 (ties to even),
    lo = t - hi rounded. What the kernels' epilogues store (kernels/softmax_bwd.py)."""
    hi = _rounded(t, BF16_ROUNDING_BIAS, 16, BF16_HI_MASK)
    return hi.to(torch.bfloat16), (t - hi).to(torch.bfloat16)


# fp16 operands are scaled so that their largest magnitude lies in [2^14, 2^15)
FP16_TOP_EXPONENT = 14
# float32 bits of a value rounded to fp16's 11 significant bits: sign, exponent and the
# top 10 mantissa bits (the mask), the bias added below them to round half to even
FP16_HI_MASK = -8192             # 0xFFFFE000 as an int32
FP16_ROUNDING_BIAS = 0xFFF


def power_of_two_scale(t, top_exponent=0):
    """2^(top_exponent - e) for the e with 2^e <= max|t| < 2^(e + 1), as a 0-dim float32
    tensor (at most 2^127; 2^127 if t is all zeros): multiplying by it is exact and
    brings max|t| into [2^top_exponent, 2^(top_exponent + 1)). Read off the exponent
    bits, so no log or pow rounds it. top_exponent: 0 to 63.

    The maximum is over t's finite elements, so that an inf or NaN in t stays where it
    is once scaled, as in unscaled math (read off an inf, the scale was -inf, and every
    gradient scaled by it NaN). The scale is at least 2^-126, a normal float32 whose
    reciprocal is finite: for max|t| >= 2^127 at top_exponent 0 it is 2^-126, and the
    scaled max|t| lies in [2, 4).

    The largest magnitude is taken per row first, then over the rows: under
    torch.use_deterministic_algorithms(True) Inductor gives a reduction its heuristic
    config instead of timing several, and one reduction of the backward's [B*S, E]
    gradient to a scalar then ran 4.56 ms per step of a 12-layer tower at batch 32 on
    the H200, against 0.40 without the flag."""
    magnitudes = t.detach().abs().nan_to_num(nan=0.0, posinf=0.0)     # finite ones
    if magnitudes.dim() > 1:
        magnitudes = magnitudes.flatten(0, -2).amax(dim=-1)              # [rows]
    exponent_bits = magnitudes.amax().float().view(torch.int32) & 0x7F800000
    top_bits = top_exponent << 23
    # biased exponent of the scale: 254 + top_exponent - that of max|t|, kept in [1, 254]
    exponent_bits = exponent_bits.clamp(top_bits, min(0x7E800000 + top_bits, 0x7F000000))
    return (0x7F000000 + top_bits - exponent_bits).view(torch.float32)


def exponents_of(powers_of_two):
    """The exponents (int32) of normal float32 powers of two (power_of_two_scale's)."""
    return (powers_of_two.view(torch.int32) >> 23) - 127


def powers_of_two(exponents):
    """2^exponents as float32, for integer exponents in [-126, 127], from their bits."""
    return ((exponents + 127) << 23).to(torch.int32).view(torch.float32)


def fp16_scale(t):
    """The power of two that brings t into fp16's range for its fp16 halves."""
    return power_of_two_scale(t, FP16_TOP_EXPONENT)


def split_fp16(t):
    """float32 t, scaled into fp16's range (fp16_scale) -> (hi, lo) fp16: hi = t rounded
    to fp16's 11 significant bits (to nearest even, by integer operations), lo = t - hi
    rounded: the split of the split GEMM's operands (split_gemm.fp16_halves), and the
    one the compiled graph gives the attention core (inductor.py).
    Elements below fp16's normal range (2^-28 of the largest, once scaled) keep about
    2^-25 of absolute precision."""
    hi = _rounded(t, FP16_ROUNDING_BIAS, 13, FP16_HI_MASK)
    return hi.to(torch.float16), (t - hi).to(torch.float16)


def operand_split(products):
    """How the forward splits its float32 operands for three products (BF16X3 or
    FP16X3): rounded to nearest for fp16x3, truncated for bf16x3."""
    return split_bf16_rounded if products.fp16_halves else split_bf16_truncated


def bf16_halves(t, split=split_bf16_truncated):
    """float32 [.., N] -> bf16 [.., 2N] = [hi | lo], one pass (truncated split unless
    `split` says otherwise)."""
    return torch.cat(split(t), dim=-1)


def mm_float32(a, b):
    """a @ b with a float32 result for bf16/fp16 operands."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def mm_half(a, b):
    """a @ b for bf16/fp16 operands -> their dtype, one product with float32
    accumulation (cuBLAS on CUDA; elsewhere a float32 matmul of the upcast operands,
    rounded once)."""
    if a.device.type == "cuda":
        return a @ b
    return (a.float() @ b.float()).to(a.dtype)


def products_halves_by_weight(a_halves, weight, split=split_bf16_truncated):
    """The two GEMMs of a [M,K] (given as halves [M,2K]) @ weight [K,N] float32 in
    bf16x3, small term first: (a_hi @ w_lo, [a_hi | a_lo] @ [w_hi ; w_hi]), each [M,N];
    the weight split by `split`."""
    K = weight.shape[0]
    w_hi, w_lo = split(weight)
    return (mm_float32(a_halves[:, :K], w_lo),
            mm_float32(a_halves, torch.cat([w_hi, w_hi], dim=0)))


def matmul_halves_by_weight(a_halves, weight, split=split_bf16_truncated):
    """a [M,K] (given as halves [M,2K]) @ weight [K,N] float32 -> [M,N], bf16x3."""
    small, rest = products_halves_by_weight(a_halves, weight, split)
    return small + rest


def linear_bf16x3(a, weight, bias):
    """F.linear(a, weight, bias) for float32 a [.., K], weight [N,K], bias [N], bf16x3
    from round-to-nearest splits (half the error of truncated ones: ~3e-6 relative at
    K = 1,024 against ~1e-5): a split once into halves (under Inductor, by the kernel
    that makes a), then the two GEMMs of matmul_halves_by_weight."""
    rows = a.reshape(-1, a.shape[-1])                                        # [M,K]
    out = matmul_halves_by_weight(bf16_halves(rows, split_bf16_rounded), weight.t(),
                                  split_bf16_rounded) + bias                 # [M,N]
    return out.view(*a.shape[:-1], weight.shape[0])


def matmul_halves_transposed(a_halves, c_halves):
    """a^T @ c for a [K,M], c [K,N] given as halves [K,2M], [K,2N] -> [M,N], bf16x3 with
    the three products as separate GEMMs (K = B*S is large)."""
    M, N = a_halves.shape[1] // 2, c_halves.shape[1] // 2
    hi_and_lo_by_c_hi = mm_float32(a_halves.t(), c_halves[:, :N])          # [2M,N]
    a_hi_by_c_lo = mm_float32(a_halves[:, :M].t(), c_halves[:, N:])        # [M,N]
    return (hi_and_lo_by_c_hi[M:] + a_hi_by_c_lo) + hi_and_lo_by_c_hi[:M]


def matmul_fp16_transposed(a16, c16):
    """a^T @ c for fp16 a [K,M], c [K,N] -> float32 [M,N], one product."""
    return mm_float32(a16.t(), c16)
