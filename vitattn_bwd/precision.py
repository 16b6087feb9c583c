"""Float32-grade matrix products at tensor-core speed.

On CUDA, `matmul_fp32_grade` is "bf16x3" through one bf16 GEMM: each float32 operand is
split into bf16 hi + lo, and
    a @ b  ~=  a_hi @ b_hi + a_lo @ b_hi + a_hi @ b_lo
           ==  [a_hi | a_lo | a_hi] @ [b_hi ; b_hi ; b_lo]        (one GEMM over 3K)
with a float32 result (relative error about 1e-5, against 3e-4 for TF32). The split is
written with integer masking, not with casts: Inductor folds a float32 -> bf16 -> float32
round trip inside a fused kernel, which would make lo == 0 silently.

`matmul_tf32` is for the one product the tolerance lets run in TF32 (the QKV weight
gradient); the compiled graph runs under `tf32_matmuls()`.

On the CPU both are plain float32 (or float64) products.
"""
import contextlib

import torch


def split_bf16(t):
    """float32 t -> (hi, lo) bf16 with hi = t truncated to bf16 and lo = bf16(t - hi)."""
    hi = (t.view(torch.int32) & -65536).view(torch.float32)
    return hi.to(torch.bfloat16), (t - hi).to(torch.bfloat16)


def matmul_fp32_grade(a, b):
    """a [M,K] @ b [K,N] -> [M,N] float32 with float32-grade accuracy."""
    if a.device.type != "cuda" or a.dtype != torch.float32:
        return a @ b
    return torch.mm(*bf16x3_operands(a, b), out_dtype=torch.float32)


def bf16x3_operands(a, b):
    """The bf16 operands of the one-GEMM bf16x3 product: a3 = [a_hi | a_lo | a_hi] [M,3K]
    and b3 = [b_hi ; b_hi ; b_lo] [3K,N]."""
    a_hi, a_lo = split_bf16(a)
    b_hi, b_lo = split_bf16(b)
    if a.stride(0) == 1 and a.stride(1) != 1:
        # a is a transposed view ([M,K] column-major, e.g. grad_rows.t() with K = B*S):
        # concatenate its transpose and transpose back, so that the GEMM's leading
        # dimension stays M. Concatenating along dim 1 would give rows of 3K bf16
        # elements, not 16-byte aligned for odd B*S, and cuBLAS slows down on those.
        a3 = torch.cat([a_hi.t(), a_lo.t(), a_hi.t()], dim=0).t()          # [M,3K]
    else:
        a3 = torch.cat([a_hi, a_lo, a_hi], dim=1)                          # [M,3K]
    b3 = torch.cat([b_hi, b_hi, b_lo], dim=0)                              # [3K,N]
    return a3, b3


def matmul_tf32(a, b):
    """a @ b; TF32 on CUDA while tf32_matmuls() is active."""
    return a @ b


@contextlib.contextmanager
def tf32_matmuls(enabled=True):
    """Let float32 cuBLAS products use TF32 inside the block, then restore the setting."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
