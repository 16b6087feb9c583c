"""The bf16 hi/lo split: exact bookkeeping, float32-grade products, and no cast folding
under Inductor."""
import torch

import pytest

from vitattn_bwd.precision import bf16x3_operands, matmul_fp32_grade, split_bf16


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_split_hi_is_truncation_and_lo_the_rounded_rest():
    t = _randn(1000) * 100
    hi, lo = split_bf16(t)
    assert hi.dtype == lo.dtype == torch.bfloat16
    # hi keeps the top 16 bits of the float32 pattern exactly
    assert torch.equal(hi.float().view(torch.int32), t.view(torch.int32) & -65536)
    rel = ((hi.float() + lo.float()).double() - t.double()).abs() / t.double().abs()
    assert rel.max() < 2 ** -16


def _bf16x3_emulated(a, b):
    """The GPU's bf16x3 GEMM on the CPU: bf16 products are exact in float32."""
    a3, b3 = bf16x3_operands(a, b)
    return a3.float() @ b3.float()


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16x3_operands_keep_the_leading_dimension_aligned(transposed):
    """A transposed `a` (grad_out_weight's grad_rows.t(), K = B*S odd) keeps M as its
    leading dimension; concatenating its rows would make it 3K (odd, misaligned)."""
    M, K, N = 64, 577, 32
    a = _randn(K, M).t() if transposed else _randn(M, K)
    b = _randn(K, N, seed=1)
    a3, b3 = bf16x3_operands(a, b)
    assert a3.shape == (M, 3 * K) and b3.shape == (3 * K, N)
    assert a3.stride() == ((1, M) if transposed else (3 * K, 1))
    a_hi, a_lo = split_bf16(a)
    assert torch.equal(a3, torch.cat([a_hi, a_lo, a_hi], dim=1))


def test_bf16x3_is_float32_grade_and_bf16_is_not():
    a, b = _randn(256, 512, seed=1), _randn(512, 128, seed=2)
    exact = a.double() @ b.double()

    def rel(x):
        return ((x.double() - exact).norm() / exact.norm()).item()

    assert rel(_bf16x3_emulated(a, b)) < 3e-5
    assert rel(a.bfloat16().float() @ b.bfloat16().float()) > 1e-3


def test_split_survives_inductor():
    """Inductor folds float32 -> bf16 -> float32 round trips; the integer-mask split has
    no such round trip, so the compiled lo part is not zero."""
    t = _randn(4096)
    compiled = torch.compile(split_bf16, fullgraph=True)
    hi, lo = compiled(t)
    ref_hi, ref_lo = split_bf16(t)
    assert torch.equal(hi, ref_hi) and torch.equal(lo, ref_lo)
    assert lo.float().abs().max() > 0


def test_cpu_matmul_is_plain_float32():
    a, b = _randn(8, 16), _randn(16, 4)
    assert torch.equal(matmul_fp32_grade(a, b), a @ b)
