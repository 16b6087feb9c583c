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


def test_module_refuses_a_batch_past_32_bit_offsets_in_the_forward():
    """At precision "highest", batch * tokens * 2 * embed_dim >= 2^31 is refused by the
    module's forward, naming x, before any work (not by the backward's trace)."""
    import vitattn_bwd
    from vitattn_bwd.module import VisionAttentionFunction
    block = vitattn_bwd.VisionAttentionBlock(64, 1).cuda()
    x = torch.empty(2 ** 24, 1, 64, device="cuda")                 # B*S*2E = 2^31
    params = [p.detach() for p in (block.norm.weight, block.norm.bias, block.qkv.weight,
                                   block.qkv.bias, block.out_proj.weight, block.out_proj.bias)]
    with pytest.raises(ValueError, match="x: precision 'highest'"):
        VisionAttentionFunction.apply(x, *params, 1, 1e-5, "highest")
