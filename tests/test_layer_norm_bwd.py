"""The LayerNorm backward: the PyTorch math against the reference, and the fused
kernel (under Triton's interpreter here; on the GPU in tests/test_gpu_layer_norm_bwd.py and
the compiled runs of tests/test_gpu.py) against float64, including its sums over rows,
the rows and columns past a block, strided inputs and no rows at all."""
import pytest
import torch

from vitattn_bwd import layer_norm_bwd, reference
from vitattn_bwd.layer_norm_bwd import LayerNormTiles


def _inputs(B, S, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    x = randn(B, S, E) * 2 + 0.5
    x_mean = x.mean(-1, keepdim=True)
    x_var = x.var(-1, unbiased=False, keepdim=True)
    parts = [randn(B * S, E) for _ in range(4)]
    return randn(B, S, E), parts, x, x_mean, x_var, randn(E)


def _want(grad_output, parts, x, x_mean, x_var, ln_weight, unscale, ln_grad, eps=1e-5):
    B, S, E = x.shape
    grad_x_norm = (sum(p.double() for p in parts) * unscale).view(B, S, E)
    grads = reference.layer_norm_backward(grad_output.double(), grad_x_norm, x.double(),
                                          x_mean.double(), x_var.double(),
                                          ln_weight.double(), eps, ln_grad)
    return (*grads, grad_output.double().sum((0, 1)))


@pytest.mark.parametrize("ln_grad", ["exact", "contract"])
def test_math_equals_reference(ln_grad):
    grad_output, parts, x, x_mean, x_var, ln_weight = _inputs(2, 5, 12)
    grad_x_norm = sum(parts).view(2, 5, 12).double()
    got = layer_norm_bwd.layer_norm_backward(grad_output.double(), grad_x_norm, x.double(),
                                         x_mean.double(), x_var.double(),
                                         ln_weight.double(), 1e-5, ln_grad)
    want = reference.layer_norm_backward(grad_output.double(), grad_x_norm, x.double(),
                                         x_mean.double(), x_var.double(),
                                         ln_weight.double(), 1e-5, ln_grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


# (B, S, E, tiles): rows that do not fill the last program, an embed dim that is not a
# power of two (masked columns), a last chunk with no rows, one row per program
@pytest.mark.parametrize("B,S,E,tiles", [
    (2, 7, 32, LayerNormTiles(2, 2, 4)),
    (1, 5, 24, LayerNormTiles(4, 4, 2)),
    (3, 11, 64, LayerNormTiles(1, 1, 4)),
])
@pytest.mark.parametrize("ln_grad", ["exact", "contract"])
def test_kernel_matches_float64(triton_interpreter, B, S, E, tiles, ln_grad):
    grad_output, parts, x, x_mean, x_var, ln_weight = _inputs(B, S, E)
    unscale = torch.tensor(0.25)
    grad_x, partial_sums = layer_norm_bwd.launch(grad_output, *parts, unscale, x, x_mean, x_var,
                                             ln_weight, 1e-5, ln_grad == "exact", tiles)
    assert partial_sums.shape == (3, -(-B * S // tiles.rows_per_program), E)
    got = (grad_x, *partial_sums.sum(1).unbind(0))
    want = _want(grad_output, parts, x, x_mean, x_var, ln_weight, 0.25, ln_grad)
    for name, g, w in zip(("grad_x", "grad_ln_weight", "grad_ln_bias", "grad_out_bias"),
                          got, want):
        err = ((g.double() - w).abs().max() / w.abs().max()).item()
        assert err < 2e-6, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("ln_grad", ["exact", "contract"])
def test_kernel_with_two_parts(triton_interpreter, ln_grad):
    """grad_x_norm as two GEMM outputs (the graph's one-product path): part2 and part3
    None, nothing else read."""
    grad_output, parts, x, x_mean, x_var, ln_weight = _inputs(2, 7, 32)
    unscale = torch.tensor(1.0)
    grad_x, partial_sums = layer_norm_bwd.launch(grad_output, *parts[:2], None, None, unscale, x,
                                             x_mean, x_var, ln_weight, 1e-5,
                                             ln_grad == "exact", LayerNormTiles(2, 2, 4))
    got = (grad_x, *partial_sums.sum(1).unbind(0))
    want = _want(grad_output, parts[:2], x, x_mean, x_var, ln_weight, 1.0, ln_grad)
    for name, g, w in zip(("grad_x", "grad_ln_weight", "grad_ln_bias", "grad_out_bias"),
                          got, want):
        err = ((g.double() - w).abs().max() / w.abs().max()).item()
        assert err < 2e-6, f"{name}: relative error {err:.2e}"


def test_operator_sums_the_partials(triton_interpreter):
    """The operator (what the graph calls) returns the partials summed, and each program's
    row of partials holds only its own rows."""
    grad_output, parts, x, x_mean, x_var, ln_weight = _inputs(1, 3, 16)
    unscale = torch.tensor(1.0)
    got = layer_norm_bwd.fused_layer_norm_backward(
        grad_output, *parts, unscale, x, x_mean, x_var, ln_weight, 1e-5, False)
    want = _want(grad_output, parts, x, x_mean, x_var, ln_weight, 1.0, "contract")
    # four tensors, none a view of another's storage (three of them become .grads)
    assert len({t.untyped_storage().data_ptr() for t in got}) == 4
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    _, partial_sums = layer_norm_bwd.launch(grad_output, *parts, unscale, x, x_mean, x_var,
                                        ln_weight, 1e-5, False, LayerNormTiles(1, 1, 4))
    assert partial_sums.shape == (3, 3, 16)
    torch.testing.assert_close(partial_sums[2], grad_output[0], rtol=0, atol=0)



def test_operator_takes_strided_inputs(triton_interpreter):
    """x transposed in memory and grad_output at an odd storage offset (as the module's
    property tests pass them): the same gradients as from contiguous copies, grad_x
    row-major. (grad_x was once allocated like x, so its strides followed x's while the
    kernel wrote it row-major: found by the GPU module property.)"""
    grad_output, parts, x, x_mean, x_var, ln_weight = _inputs(3, 5, 16)
    x_strided = x.transpose(0, 1).contiguous().transpose(0, 1)          # [B,S,E], S-major
    padded = torch.zeros(grad_output.numel() + 3)
    grad_output_strided = padded[3:].view_as(grad_output).copy_(grad_output)
    args = (*parts, torch.tensor(1.0))
    got = layer_norm_bwd.fused_layer_norm_backward(grad_output_strided, *args, x_strided,
                                               x_mean, x_var, ln_weight, 1e-5, True)
    want = layer_norm_bwd.fused_layer_norm_backward(grad_output, *args, x, x_mean, x_var,
                                                ln_weight, 1e-5, True)
    assert got[0].is_contiguous()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_operator_with_no_rows(triton_interpreter):
    """B * S = 0: an empty grad_x and zero sums (no program is launched)."""
    grad_output, parts, x, x_mean, x_var, ln_weight = _inputs(0, 5, 16)
    grad_x, *column_sums = layer_norm_bwd.fused_layer_norm_backward(
        grad_output, *parts, torch.tensor(1.0), x, x_mean, x_var, ln_weight, 1e-5, True)
    assert grad_x.shape == (0, 5, 16)
    assert all(s.shape == (16,) and (s == 0).all() for s in column_sums)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_of_a_half_precision_block(triton_interpreter, dtype):
    """grad_output, x and ln_weight in bf16 / fp16 (a bf16 / fp16 block), the two GEMM
    outputs and the statistics float32: float32 math, grad_x in that dtype (rounded
    once), the sums float32."""
    grad_output, parts, x, x_mean, x_var, ln_weight = _inputs(2, 7, 32)
    grad_output, x, ln_weight = (t.to(dtype) for t in (grad_output, x, ln_weight))
    grad_x, partial_sums = layer_norm_bwd.launch(grad_output, *parts[:2], None, None,
                                             torch.tensor(1.0), x, x_mean, x_var,
                                             ln_weight, 1e-5, True, LayerNormTiles(2, 2, 4))
    assert grad_x.dtype == dtype and partial_sums.dtype == torch.float32
    want = _want(grad_output, parts[:2], x, x_mean, x_var, ln_weight, 1.0, "exact")
    unit_roundoff = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    for name, g, w, bound in zip(("grad_x", "grad_ln_weight", "grad_ln_bias",
                                  "grad_out_bias"), (grad_x, *partial_sums.sum(1).unbind(0)),
                                 want, (unit_roundoff, 2e-6, 2e-6, 2e-6)):
        err = ((g.double() - w).abs().max() / w.abs().max()).item()
        assert err < bound, f"{name}: relative error {err:.2e}"


def test_launch_refuses_other_dtypes():
    grad_output, parts, x, x_mean, x_var, ln_weight = _inputs(1, 3, 16)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        layer_norm_bwd.launch(grad_output, *parts, torch.tensor(1.0), x.double(), x_mean,
                          x_var, ln_weight, 1e-5, True)
    with pytest.raises(TypeError, match="grad_output must have x's dtype"):
        layer_norm_bwd.launch(grad_output.bfloat16(), *parts, torch.tensor(1.0), x, x_mean,
                          x_var, ln_weight, 1e-5, True)
