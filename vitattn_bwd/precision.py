"""Float32-grade matrix products at tensor-core speed, from operands split once.

"bf16x3": a float32 operand is split into bf16 hi + lo (hi + lo carries about 16 of its
24 mantissa bits), and

    a @ b  ~=  a_hi @ b_hi + a_lo @ b_hi + a_hi @ b_lo        (relative error ~1e-5)

with float32 accumulation. An activation is split once into its "halves", one bf16
tensor [.., 2N] = [hi | lo], that several GEMMs read as it lies: for a weight b,

    a @ b  =  [a_hi | a_lo] @ [b_hi ; b_hi]  +  a_hi @ b_lo              (two GEMMs)

and for a weight gradient a^T @ c summed over many rows (K = B*S), the three products
are separate GEMMs added small terms first, which stays accurate at large K (CONTRACT.md,
"Accumulation error at large K"):

    a^T @ c  =  ([a_hi | a_lo]^T @ c_hi  ->  a_hi^T c_hi ; a_lo^T c_hi)  +  a_hi^T @ c_lo

The QKV weight gradient, which the contract's tolerance lets run on one product, is ONE
GEMM of round-to-nearest fp16 operands (unbiased, unlike truncating TF32) at precision
"high"; "highest" takes it as bf16x3 like the others (graph.py).

Splits are written with integer masking, not with casts: Inductor folds a float32 ->
bf16 -> float32 round trip inside a fused kernel, which would make lo == 0 silently.

On CUDA the GEMMs are cuBLAS bf16/fp16 GEMMs with a float32 result; elsewhere the same
products run as float32 matmuls of the upcast parts, which is exact for products of
bf16 or fp16 values: the CPU reproduces the GPU's arithmetic up to summation order.
"""
import torch

# The precisions of the fused float32 path, PyTorch's names for float32 matmul precision
# (torch.set_float32_matmul_precision): "highest", every GEMM bf16x3 from splits rounded
# to nearest, the QKV weight gradient's too; "high" the fastest map the benchmark's
# tolerance allows, truncated splits and one fp16 product for the QKV weight gradient.
# The attention core is bf16x3 at both (graph.py).
FUSED_PRECISIONS = ("highest", "high")


def check_fused_precision(precision):
    """`precision` if it is one of FUSED_PRECISIONS, else ValueError naming them."""
    if precision not in FUSED_PRECISIONS:
        raise ValueError(f"precision must be one of {FUSED_PRECISIONS}, got {precision!r}")
    return precision

# float32 bits of the bf16 part of a value: sign, exponent and the top 7 mantissa bits
BF16_HI_MASK = -65536            # 0xFFFF0000 as an int32
BF16_ROUNDING_BIAS = 0x7FFF      # added below the bf16 bits: round half to even


def split_bf16_truncated(t):
    """float32 t -> (hi, lo) bf16: hi = t truncated to bf16, lo = t - hi rounded."""
    hi = (t.view(torch.int32) & BF16_HI_MASK).view(torch.float32)
    return hi.to(torch.bfloat16), (t - hi).to(torch.bfloat16)


def split_bf16_rounded(t):
    """float32 t -> (hi, lo) bf16: hi = t rounded to the nearest bf16 (ties to even),
    lo = t - hi rounded. What the kernels' epilogues store (kernels/softmax_bwd.py)."""
    bits = t.view(torch.int32)
    hi = ((bits + BF16_ROUNDING_BIAS + ((bits >> 16) & 1)) & BF16_HI_MASK).view(torch.float32)
    return hi.to(torch.bfloat16), (t - hi).to(torch.bfloat16)


def power_of_two_scale(t):
    """2^-e for the e with 2^e <= max|t| < 2^(e + 1), as a 0-dim float32 tensor (2^127
    if t is all zeros): multiplying by it is exact and brings max|t| into [1, 2). Read
    off the exponent bits, so no log or pow rounds it."""
    exponent_bits = t.detach().abs().amax().float().view(torch.int32) & 0x7F800000
    return (0x7F000000 - exponent_bits).view(torch.float32)


def operand_split(precision):
    """How a precision of FUSED_PRECISIONS splits the GEMMs' float32 operands: rounded to
    nearest for "highest", truncated for "high"."""
    return split_bf16_rounded if precision == "highest" else split_bf16_truncated


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
