"""The split GEMM operator of precision "highest" (split_gemm.py) on the CPU: its
Triton kernel under the interpreter and its float32 math, against float64, with
operands far from fp16's range and a transposed view; its argument checks; the
lowering's fallback under torch.compile. (On the GPU: tests/test_gpu_split_gemm.py.)"""
import pytest
import torch

from vitattn_bwd import split_gemm

from .helpers import relative_error


def _operands(M, K, N, seed, a_magnitude=1e-6, b_magnitude=3e2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g) * a_magnitude,
            torch.randn(K, N, generator=g) * b_magnitude,
            torch.randn(M, N, generator=g))


def _check_against_float32(a, b, c):
    """a @ b and a^T @ c from the operator within 2x float32 matmul's own error."""
    want, want_t = a.double() @ b.double(), a.double().t() @ c.double()
    got = split_gemm.matmul_fp16x3(split_gemm.fp16_halves(a), split_gemm.fp16_halves(b))
    got_t = split_gemm.matmul_fp16x3(split_gemm.transposed(split_gemm.fp16_halves(a)),
                                     split_gemm.fp16_halves(c))
    assert got.dtype == got_t.dtype == torch.float32
    assert got.shape == want.shape and got_t.shape == want_t.shape
    assert relative_error(got, want) < 2 * relative_error(a @ b, want) + 1e-8
    assert relative_error(got_t, want_t) < 2 * relative_error(a.t() @ c, want_t) + 1e-8


@pytest.mark.parametrize("M,K,N", [(70, 50, 40), (20, 33, 130)])
def test_kernel_is_float32_grade(triton_interpreter, M, K, N):
    """The Triton kernel (masked rows, columns and K slice) with operands at 1e-6 and
    3e2, far outside fp16's normal range without their scales."""
    _check_against_float32(*_operands(M, K, N, seed=M))


def test_math_is_float32_grade(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check_against_float32(*_operands(70, 50, 40, seed=1))


TINY = dict(a_magnitude=1e-18, b_magnitude=1e-15)   # scales 2^74 and 2^64: 2^138 > float32


def test_kernel_unscales_tiny_operands_one_scale_at_a_time(triton_interpreter):
    """Operands whose scales' product overflows float32 while their product (~1e-32) is
    a normal float32: the scales come out one after the other."""
    _check_against_float32(*_operands(40, 50, 30, seed=5, **TINY))


def test_math_unscales_tiny_operands_one_scale_at_a_time(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check_against_float32(*_operands(40, 50, 30, seed=5, **TINY))


def test_kernel_and_math_agree_to_rounding(triton_interpreter, monkeypatch):
    a, b, _ = _operands(64, 96, 48, seed=2)
    halves_a, halves_b = split_gemm.fp16_halves(a), split_gemm.fp16_halves(b)
    kernel = split_gemm.matmul_fp16x3(halves_a, halves_b)
    monkeypatch.delenv("TRITON_INTERPRET")
    math = split_gemm.matmul_fp16x3(halves_a, halves_b)
    assert not torch.equal(kernel, torch.zeros_like(kernel))
    torch.testing.assert_close(kernel, math, rtol=1e-6, atol=1e-6 * math.abs().max().item())


def test_bad_arguments_are_refused_by_name():
    a, b, _ = _operands(8, 16, 8, seed=3)
    ha, hb = split_gemm.fp16_halves(a), split_gemm.fp16_halves(b)
    scale = torch.ones(2)
    with pytest.raises(ValueError, match="a_hi must be a 2-d float16"):
        split_gemm.split_gemm(ha.hi.float(), ha.lo, hb.hi, hb.lo, scale)
    with pytest.raises(ValueError, match="b_lo"):
        split_gemm.split_gemm(ha.hi, ha.lo, hb.hi, hb.lo[:4], scale)
    with pytest.raises(ValueError, match="do not multiply"):
        split_gemm.split_gemm(ha.hi, ha.lo, ha.hi, ha.lo, scale)
    with pytest.raises(ValueError, match="unscale must be a float32 \\[2\\]"):
        split_gemm.split_gemm(ha.hi, ha.lo, hb.hi, hb.lo, torch.ones(1))


def test_compiled_cpu_graph_goes_through_the_lowering_fallback(monkeypatch):
    """On the CPU the lowering hands the operator back to its implementation."""
    pytest.importorskip("vitattn_bwd.inductor")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a, b, _ = _operands(40, 24, 16, seed=4)

    def product(a, b):
        return split_gemm.matmul_fp16x3(split_gemm.transposed(split_gemm.fp16_halves(a)),
                                        split_gemm.fp16_halves(b))
    from vitattn_bwd.inductor import compile_options
    compiled = torch.compile(product, fullgraph=True,
                             options=compile_options("test-split-gemm", max_autotune=False))
    c = torch.randn(40, 16)
    assert torch.equal(compiled(a, c), product(a, c))


def test_operands_of_2_31_elements_are_refused_by_name():
    """The kernel's offsets are 32-bit: the module and the contract entry point check
    the widest operand (grad_kv [B*S, 2E]) in the call, before any work."""
    split_gemm.check_operand_elements("x", 2 ** 20, 2047)           # 2^31 - 2^20 elements
    with pytest.raises(ValueError, match=r"x: precision 'highest' .* \[1048576, 2048\]"):
        split_gemm.check_operand_elements("x", 2 ** 20, 2048)           # 2^31
