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


# 1/scales near 2^105 and 2^-26: a tile times 2^105 first (~2^136) left float32's range
HUGE = dict(a_magnitude=1e36, b_magnitude=1e-4)


def test_kernel_unscales_a_huge_operand_smaller_scale_first(triton_interpreter):
    """Operands of 1e36 and 1e-4, whose product (~1e33) is a normal float32: the
    unscale's two factors are balanced, so no partial product overflows."""
    _check_against_float32(*_operands(40, 50, 30, seed=6, **HUGE))


def test_math_unscales_a_huge_operand_smaller_scale_first(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check_against_float32(*_operands(40, 50, 30, seed=6, **HUGE))


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


def _counting_split_gemm_calls(monkeypatch):
    """A list that records the K of every split GEMM operator call made through
    matmul_fp16x3 from now on."""
    calls, operator = [], split_gemm.split_gemm

    def counted(a_hi, a_lo, b_hi, b_lo, unscale):
        calls.append(a_hi.shape[1])
        return operator(a_hi, a_lo, b_hi, b_lo, unscale)
    monkeypatch.setattr(split_gemm, "split_gemm", counted)
    return calls


@pytest.mark.parametrize("K, chunks", [(64, 1), (301, 4)])
def test_kernel_takes_long_k_in_chunks(triton_interpreter, monkeypatch, K, chunks):
    """K up to K_CHUNK (here 64 instead of 2^15) in one call, past it in K_CHUNKS chunks
    (here 4: 301 = 3 x 76 + 73): float32-grade, a transposed operand's chunks read as
    views, the same bits when repeated."""
    monkeypatch.setattr(split_gemm, "K_CHUNK", 64)
    monkeypatch.setattr(split_gemm, "K_CHUNKS", 4)
    a, _, c = _operands(K, 24, 20, seed=K)                          # a^T @ c: K rows
    calls = _counting_split_gemm_calls(monkeypatch)
    halves_a, halves_c = split_gemm.transposed(split_gemm.fp16_halves(a)), \
        split_gemm.fp16_halves(c)
    got = split_gemm.matmul_fp16x3(halves_a, halves_c)
    assert calls == ([K] if chunks == 1 else [76, 76, 76, 73])
    want = a.double().t() @ c.double()
    assert relative_error(got, want) < 2 * relative_error(a.t() @ c, want) + 1e-8
    assert torch.equal(got, split_gemm.matmul_fp16x3(halves_a, halves_c))


def test_compiled_dynamic_k_is_not_specialized_by_the_chunks(monkeypatch):
    """Compiled with K dynamic (the backward graphs mark the batch dynamic, and K = B*S),
    across K_CHUNK (here 16, in 4 chunks): K = 40 and then 70 run in chunks through one
    graph (a second compile fails the test; a loop over chunks of a fixed length would
    specialize K: dynamo's ConstraintViolationError), K = 12 runs unchunked, each as the
    eager call computes (in chunks, whose sum's rounding an unchunked graph would not
    repeat bit for bit)."""
    pytest.importorskip("vitattn_bwd.inductor")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(split_gemm, "K_CHUNK", 16)
    monkeypatch.setattr(split_gemm, "K_CHUNKS", 4)

    def product(a, c):
        return split_gemm.matmul_fp16x3(split_gemm.transposed(split_gemm.fp16_halves(a)),
                                        split_gemm.fp16_halves(c))
    from vitattn_bwd.inductor import compile_options
    compiled = torch.compile(product, fullgraph=True, dynamic=False, options=compile_options(
        "test-split-gemm-chunks", max_autotune=False))
    for K in (40, 70, 12):
        a, _, c = _operands(K, 16, 24, seed=K)                      # a^T @ c: K rows
        torch._dynamo.mark_dynamic(a, 0)
        torch._dynamo.mark_dynamic(c, 0)
        with torch.compiler.set_stance("fail_on_recompile" if K == 70 else "default"):
            got = compiled(a, c)
        assert torch.equal(got, product(a, c)), K
        want = a.double().t() @ c.double()
        assert relative_error(got, want) < 2 * relative_error(a.t() @ c, want) + 1e-8, K


def test_offsets_are_64_bit_only_where_a_tensor_spans_2_31_elements():
    """The raw launch's OFFSET_DTYPE (meta tensors: nothing is allocated): grad_kv
    [B*S, 2E] at 2^31 - 2^20 elements and its transposed view keep int32 offsets, at
    2^31 elements either takes int64, and so does a small view whose stride spans it."""
    import triton.language as tl

    def meta(*shape):
        return torch.empty(shape, dtype=torch.float16, device="meta")
    assert split_gemm.offset_dtype(meta(2 ** 20, 2047), meta(2047, 64)) == tl.int32
    assert split_gemm.offset_dtype(meta(2 ** 20, 2047).t(), meta(2 ** 20, 64)) == tl.int32
    assert split_gemm.offset_dtype(meta(2 ** 20, 2048), meta(2048, 64)) == tl.int64
    assert split_gemm.offset_dtype(meta(64, 2048), meta(2 ** 20, 2048).t()) == tl.int64
    assert split_gemm.offset_dtype(meta(3, 16).as_strided((3, 16), (2 ** 30, 1))) == tl.int64
    assert split_gemm.offset_dtype(meta(0, 2 ** 31)) == tl.int32         # empty: no offsets


# Operands a few elements large whose strides reach past 2^31 elements: where int32
# offsets wrap (to `wrapped_at`, as a storage index) other values are planted; each
# operand's halves are views of one 8 GiB fp16 storage, of which only the elements read
# and the planted ones are touched (the allocation is virtual; the interpreter hands a
# CPU tensor's storage to the kernel without copying it).
# (shape, strides, base offset of a_hi, storage index an int32 offset wraps to)
PLANTED = {
    # row 2 of A starts at 2 * 3 * 2^29 = 3 * 2^30: rows * stride_am wraps
    "rows": ((3, 16), (3 * 2 ** 29, 1), 2 ** 30, 0),
    # K = 33 with stride_ak 2^26: the second K slice starts 32 * 2^26 = 2^31 on (the
    # loop's step times the stride wraps)
    "k slices": ((4, 33), (1, 2 ** 26), 2 ** 31, 0),
}


@pytest.mark.parametrize("case", PLANTED)
def test_kernel_reads_operands_spanning_2_31_elements(triton_interpreter, case):
    """A @ B with A's halves as planted views against float64: with 32-bit offsets the
    kernel would read the planted values (1e3) for some of A's."""
    shape, strides, offset, wrapped_at = PLANTED[case]
    a, b, _ = _operands(shape[0], shape[1], 24, seed=6)
    halves = split_gemm.fp16_halves(a)
    lo_shift = 8 if case == "k slices" else shape[1]     # a_lo's base after a_hi's
    storage = torch.empty(offset + lo_shift + 1 + sum((n - 1) * st
                                                     for n, st in zip(shape, strides)),
                          dtype=torch.float16)
    storage[wrapped_at:wrapped_at + 2 * lo_shift] = 1e3          # the planted values
    a_hi = storage.as_strided(shape, strides, offset)
    a_lo = storage.as_strided(shape, strides, offset + lo_shift)
    a_hi.copy_(halves.hi)
    a_lo.copy_(halves.lo)
    assert split_gemm.span(a_hi) >= split_gemm.INT32_OFFSET_LIMIT
    got = split_gemm.matmul_fp16x3(split_gemm.Fp16Halves(a_hi, a_lo, halves.scale),
                                   split_gemm.fp16_halves(b))
    want = a.double() @ b.double()
    assert relative_error(got, want) < 2 * relative_error(a @ b, want) + 1e-8
