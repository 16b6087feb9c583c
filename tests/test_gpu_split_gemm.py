"""On the GPU: the split GEMM of precision "highest" (split_gemm.py), compiled (the
Inductor template, autotuned) and raw (every configured tile), at the block's GEMM
shapes, against float64 and against float32 SGEMM's own error. Operands carry column
means, as gradients do, so that a product accumulated in one tensor-core accumulator
over all of K (cuBLAS fp16x3: 50-190x SGEMM's error at K = 18,464) would fail the bound."""
import pytest
import torch

from vitattn_bwd import inductor, split_gemm

from .helpers import relative_error

pytestmark = pytest.mark.gpu

E, S = 1024, 577


def _operands(rows, a_width, b_width, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def gradient_like(*shape):
        return (torch.randn(*shape, device="cuda", generator=g)
                + 0.5 * torch.randn(1, shape[1], device="cuda", generator=g))
    return gradient_like(rows, a_width), gradient_like(rows, b_width)


def _faithful(a, b):
    return split_gemm.matmul_fp16x3(split_gemm.fp16_halves(a), split_gemm.fp16_halves(b))


def _faithful_transposed(a, b):
    return split_gemm.matmul_fp16x3(split_gemm.transposed(split_gemm.fp16_halves(a)),
                                    split_gemm.fp16_halves(b))


def _sgemm(a, b):
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("batch", [2, 5, 32])
@pytest.mark.parametrize("transposed", [False, True], ids=["a@b", "a^T@c"])
def test_compiled_is_as_close_to_float64_as_sgemm(batch, transposed):
    """The block's activation-gradient product (K = E) and weight-gradient product (K =
    B*S), compiled with a dynamic M (batches 2 and 5 share a graph), bitwise repeatable."""
    if transposed:
        a, b = _operands(batch * S, E, E, seed=batch)
        fn, a_op = _faithful_transposed, a.t()
    else:
        a, _ = _operands(batch * S, E, E, seed=batch)
        b = torch.randn(E, E, device="cuda") / 32
        fn, a_op = _faithful, a
    compiled = torch.compile(fn, dynamic=batch != 32, options=inductor.compile_options(
        f"test-split-gemm-{transposed}", max_autotune=False))
    want = a_op.double() @ b.double()
    got = compiled(a, b)
    assert torch.equal(got, compiled(a, b))
    error, sgemm_error = relative_error(got, want), relative_error(_sgemm(a_op, b), want)
    assert error < 1.5 * sgemm_error, (error, sgemm_error)


@pytest.mark.parametrize("tiles", inductor.GEMM_TILES, ids=str)
def test_every_configured_tile_is_as_close_to_float64_as_sgemm(tiles):
    a, b = _operands(7 * S, E, E, seed=7)
    halves_a, halves_b = split_gemm.transposed(split_gemm.fp16_halves(a)), \
        split_gemm.fp16_halves(b)
    got = split_gemm.launch(halves_a.hi, halves_a.lo, halves_b.hi, halves_b.lo,
                            split_gemm.unscale_of(halves_a, halves_b), tiles)
    want = a.double().t() @ b.double()
    assert relative_error(got, want) < 1.5 * relative_error(_sgemm(a.t(), b), want)


# A [BIG_ROWS, 2E] spans 2^31 + 2^21 elements: grad_kv's [B*S, 2E] passes 2^31 from batch
# 1,818 at ViT-L/14-336. Rows from 2^20 on start past 2^31 elements: with 32-bit offsets
# they would read other memory. (8.6 GB float32, its fp16 halves as much again.)
BIG_ROWS = 2 ** 20 + 2 ** 10
TAIL = slice(2 ** 20, None)                     # the rows whose offsets pass 2^31


def _big_products(compiled):
    """A @ W and A^T @ C for A [BIG_ROWS, 2E], raw launches (the eager path's 64-bit
    OFFSET_DTYPE) or compiled (the template, Inductor's INDEX_DTYPE), with float64
    products and SGEMM's for comparison: [(ours, float64, SGEMM's)] for each, and A @ W's
    pair on TAIL's rows."""
    a, c = _operands(BIG_ROWS, 2 * E, 64, seed=11)
    w = torch.randn(2 * E, 64, device="cuda") / 32
    options = inductor.compile_options(f"test-split-gemm-big-{compiled}", max_autotune=False)
    fns = [_faithful, _faithful_transposed]
    if compiled:
        fns = [torch.compile(fn, dynamic=False, options=options) for fn in fns]
    product, product_t = fns[0](a, w), fns[1](a, c)
    a64 = a.double()
    want, want_t = a64 @ w.double(), a64.t() @ c.double()
    del a64
    tail = (product[TAIL], want[TAIL], _sgemm(a[TAIL], w))
    return (product, want, _sgemm(a, w)), (product_t, want_t, _sgemm(a.t(), c)), tail


@pytest.mark.parametrize("compiled", [False, True], ids=["launch", "compiled"])
def test_an_operand_past_2_31_elements(compiled):
    """A @ W (output [BIG_ROWS, 64]: the activation gradient's GEMM, K = 2E) and A^T @ C
    (the weight gradient's, K = BIG_ROWS, past split_gemm.K_CHUNK rows in K_CHUNKS
    chunks, each within 32-bit offsets) as close to float64 as float32 SGEMM, and A @ W
    on the rows past 2^31 elements alone: rows read through wrapped 32-bit offsets would
    be other memory, an error of order one."""
    product, product_t, tail = _big_products(compiled)
    for got, want, sgemm in (product, tail, product_t):
        assert relative_error(got, want) < 1.5 * relative_error(sgemm, want)
