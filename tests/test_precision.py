"""The bf16 hi/lo splits and the split-operand GEMMs: exact bookkeeping, float32-grade
products, and no cast folding under Inductor. On the CPU the GEMMs multiply the upcast
parts, which reproduces the GPU's products exactly."""
import pytest
import torch

from vitattn_bwd.precision import (BF16_HI_MASK, Products, bf16_halves, fp16_scale,
                                   fused_products, linear_bf16x3, power_of_two_scale,
                                   split_fp16, matmul_fp16_transposed,
                                   matmul_halves_by_weight, matmul_halves_transposed,
                                   split_bf16_rounded, split_bf16_truncated)

FP16X3 = Products.FP16X3.value          # the attention-core operators' "highest"


def _graph_products(precision):
    """The CUDA graph's products at a precision (None: plain ones), run on the CPU."""
    return Products.PLAIN if precision is None else fused_products(precision)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(x, exact):
    return ((x.double() - exact).norm() / exact.norm()).item()


def test_truncated_split_keeps_the_top_bits_and_rounds_the_rest():
    t = _randn(1000) * 100
    hi, lo = split_bf16_truncated(t)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi.float().view(torch.int32), t.view(torch.int32) & BF16_HI_MASK)
    rel = ((hi.float() + lo.float()).double() - t.double()).abs() / t.double().abs()
    assert rel.max() < 2 ** -16


def test_rounded_split_rounds_to_nearest_even_like_a_cast():
    t = torch.cat([_randn(10000) * 100,
                   torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8)])])
    hi, lo = split_bf16_rounded(t)
    assert torch.equal(hi, t.bfloat16())                 # torch rounds half to even
    assert torch.equal(lo, (t - hi.float()).bfloat16())


@pytest.mark.parametrize("split", [split_bf16_truncated, split_bf16_rounded])
def test_splits_survive_inductor(split):
    """Inductor folds float32 -> bf16 -> float32 round trips; the integer-mask splits
    have none to fold, so the compiled lo part is not zero."""
    t = _randn(4096)
    hi, lo = torch.compile(split, fullgraph=True)(t)
    ref_hi, ref_lo = split(t)
    assert torch.equal(hi, ref_hi) and torch.equal(lo, ref_lo)
    assert lo.float().abs().max() > 0


def test_halves_are_hi_then_lo():
    t = _randn(7, 5)
    hi, lo = split_bf16_truncated(t)
    assert torch.equal(bf16_halves(t), torch.cat([hi, lo], dim=1))


def test_matmul_by_weight_is_float32_grade_and_bf16_is_not():
    a, w = _randn(256, 512, seed=1), _randn(512, 128, seed=2)
    exact = a.double() @ w.double()
    assert _rel(matmul_halves_by_weight(bf16_halves(a), w), exact) < 3e-5
    assert _rel(a.bfloat16().float() @ w.bfloat16().float(), exact) > 1e-3


def test_transposed_matmul_sums_three_products_at_large_k():
    """a^T c over K = 4,000 rows (a weight gradient): float32-grade, from the halves."""
    a, c = _randn(4000, 48, seed=3), _randn(4000, 40, seed=4)
    exact = a.double().t() @ c.double()
    got = matmul_halves_transposed(bf16_halves(a), bf16_halves(c))
    assert got.shape == (48, 40) and _rel(got, exact) < 3e-5


def test_fp16_transposed_matmul_is_one_rounded_product():
    a, c = _randn(3000, 32, seed=5), _randn(3000, 16, seed=6)
    exact = a.double().t() @ c.double()
    err = _rel(matmul_fp16_transposed(a.half(), c.half()), exact)
    assert 1e-5 < err < 1e-3                          # fp16-grade, not float32-grade


def test_linear_bf16x3_is_float32_grade_from_rounded_splits():
    """The module forward's projections on CUDA: ~3e-6 relative at K = 1,024 (a truncated
    split gives ~1e-5), against ~1.6e-3 for one bf16 product; batch dims kept."""
    x, w, b = _randn(2, 100, 1024, seed=7), _randn(384, 1024, seed=8) / 32, _randn(384, seed=9)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = linear_bf16x3(x, w, b)
    assert got.shape == (2, 100, 384) and got.dtype == torch.float32
    assert _rel(got, exact) < 6e-6
    one_bf16_product = torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float(), b)
    assert _rel(one_bf16_product, exact) > 1e-3


@pytest.mark.parametrize("magnitude", [1e-30, 1e-7, 1.0, 1e20])
def test_power_of_two_scale_brings_the_largest_element_into_one_to_two(magnitude):
    t = _randn(100) * magnitude
    scaled = t * power_of_two_scale(t)
    assert 1 <= scaled.abs().max() < 2
    assert torch.equal(scaled / power_of_two_scale(t), t)         # exact both ways


@pytest.mark.parametrize("shape", [(7, 33), (2, 5, 17)])
def test_power_of_two_scale_of_a_matrix_reads_its_largest_element(shape):
    """The row-then-column maximum finds the largest element wherever it lies."""
    for flat_index in (0, 12, -1):
        t = _randn(*shape) * 1e-3
        t.view(-1)[flat_index] = -3.5
        assert power_of_two_scale(t) == 0.5 and power_of_two_scale(t, 14) == 2.0 ** 13


def test_power_of_two_scale_of_zeros_is_finite():
    scale = power_of_two_scale(torch.zeros(5))
    assert scale == 2.0 ** 127 and torch.equal(torch.zeros(5) * scale, torch.zeros(5))


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_power_of_two_scale_reads_the_finite_elements_only(bad):
    """An inf or NaN leaves the scale to the finite elements (scaled, it stays an inf
    or NaN), where it made the scale -inf and every scaled element NaN."""
    t = _randn(7, 33) * 1e-3
    t[2, 5] = -3.5
    t[4, 1] = bad
    assert power_of_two_scale(t) == 0.5 and power_of_two_scale(t, 14) == 2.0 ** 13
    scaled = t * power_of_two_scale(t)
    assert torch.equal(torch.isfinite(scaled), torch.isfinite(t))


def test_power_of_two_scale_stays_a_normal_float_at_the_top_of_float32():
    """max|t| in [2^127, 2^128): at top_exponent 0 the scale 2^-127 is not a normal
    float32 (it was 0, and 1 / scale inf); 2^-126 takes max|t| into [2, 4), exactly."""
    t = _randn(100)
    t[3] = 2.0 ** 127 * 1.5
    scale = power_of_two_scale(t)
    assert scale == 2.0 ** -126 and torch.isfinite(1 / scale)
    assert 2 <= (t * scale).abs().max() < 4
    normal = t.abs() >= 1                          # scaled, still normal float32s: exact
    assert torch.equal((t * scale / scale)[normal], t[normal])
    assert power_of_two_scale(t, 14) == 2.0 ** (14 - 127)


@pytest.mark.parametrize("precision", ["high", "highest"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 2.0 ** 120])
def test_split_products_keep_non_finite_gradients_where_the_math_has_them(
        triton_interpreter, precision, bad):
    """The CUDA graph's products, run here on the CPU, with one inf, NaN or 2^120 in the
    upstream gradient: its outputs are non-finite exactly where float32 eager math's
    are, and finite ones as close to float64 as with finite inputs. (An inf made
    "high"'s gradient scale -inf, and every output NaN; at "highest" the finite ones
    were wrong; 2^120 overflowed a split GEMM's tile as it was unscaled.)"""
    from tests.helpers import make_case, reference_grads
    from vitattn_bwd import graph
    from vitattn_bwd.workloads import OUTPUT_NAMES
    inputs = make_case(2, 17, 4, 16, seed=3)
    inputs["grad_output"][1, 3, 5] = bad
    tensors = {name: t for name, t in inputs.items() if torch.is_tensor(t)}
    tensors["probs"] = tensors.pop("attn_weights")           # P, as the graph names it
    outputs = graph.block_backward(**{n: t for n, t in tensors.items() if n != "x_norm"},
                                   x_norm=tensors["x_norm"], scale=inputs["scale"],
                                   norm_eps=inputs["norm_eps"], ln_grad="contract",
                                   products=_graph_products(precision))
    float32_math = reference_grads(inputs, 4, "contract", dtype=torch.float32)
    exact = reference_grads(inputs, 4, "contract")
    for name, got, math, want in zip(OUTPUT_NAMES, outputs, float32_math, exact):
        finite = torch.isfinite(got)
        assert torch.equal(finite, torch.isfinite(math)), name
        if finite.any():
            error = (got.double() - want)[finite].abs().max() / want[finite].abs().max()
            assert error < 1e-3, (name, error.item())


@pytest.mark.parametrize("loss_scale", [1.0, 1e-5, 1e-7, 1e-9])
def test_split_products_keep_the_qkv_weight_gradient_at_small_loss_scales(
        triton_interpreter, loss_scale):
    """The CUDA graph's products (fp16 QKV weight gradient, bf16x3 elsewhere), run here
    on the CPU, which reproduces their roundings: with the upstream gradient of a mean
    loss (1e-7 and below) fp16 alone would lose the QKV weight gradient (measured on the
    H200: 5e-2 relative error at 1e-5, 1.0 at 1e-7). Scaled by a power of two, every
    output keeps the error it has at scale 1."""
    from tests.helpers import make_case, reference_grads, relative_errors
    from vitattn_bwd import graph
    from vitattn_bwd.workloads import OUTPUT_NAMES
    inputs = make_case(2, 17, 4, 16, seed=3)
    inputs["grad_output"] = inputs["grad_output"] * loss_scale
    tensors = {name: t for name, t in inputs.items() if torch.is_tensor(t)}
    tensors["probs"] = tensors.pop("attn_weights")           # P, as the graph names it
    outputs = graph.block_backward(**{n: t for n, t in tensors.items() if n != "x_norm"},
                                   x_norm=tensors["x_norm"], scale=inputs["scale"],
                                   norm_eps=inputs["norm_eps"], ln_grad="contract",
                                   products=_graph_products("high"))
    errors = dict(zip(OUTPUT_NAMES, relative_errors(outputs, reference_grads(
        inputs, 4, "contract"))))
    assert errors["grad_qkv_weight"] < 1e-3, errors
    assert all(err < 1e-4 for name, err in errors.items() if name != "grad_qkv_weight"), errors


def test_highest_products_are_float32s_on_the_cpu(monkeypatch):
    """precision "highest" (the CUDA graph's map, run here on the CPU: the split GEMM
    operator's float32 math on fp16 halves and the attention core's operator with operand
    scales, whose CPU math, without Triton's interpreter, is float64): every output as
    close to float64 as the plain float32 graph's, where "high"'s truncated bf16x3
    splits are ~1e-5 off and its one fp16 product ~3e-4."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from tests.helpers import make_case, reference_grads, relative_errors
    from vitattn_bwd import graph
    from vitattn_bwd.workloads import OUTPUT_NAMES
    inputs = make_case(2, 17, 4, 16, seed=4)
    tensors = {name: t for name, t in inputs.items() if torch.is_tensor(t)}
    tensors["probs"] = tensors.pop("attn_weights")           # P, as the graph names it
    want = reference_grads(inputs, 4, "contract")
    errors = {}
    for precision in ("high", "highest", None):
        outputs = graph.block_backward(**tensors, scale=inputs["scale"],
                                       norm_eps=inputs["norm_eps"], ln_grad="contract",
                                       products=_graph_products(precision))
        errors[precision] = dict(zip(OUTPUT_NAMES, relative_errors(outputs, want)))
    high, highest, plain = errors["high"], errors["highest"], errors[None]
    for name in OUTPUT_NAMES:
        assert highest[name] <= 1.5 * plain[name] + 1e-8, (name, errors)
    assert high["grad_qkv_weight"] > 100 * highest["grad_qkv_weight"], errors
    assert high["grad_out_weight"] > 10 * highest["grad_out_weight"], errors


def test_split_fp16_is_float32_grade_compiled_too():
    """fp16 halves of a tensor scaled by fp16_scale: its largest magnitude in [2^14,
    2^15), hi the nearest fp16, hi + lo within 2^-21 of the largest element, eagerly and
    under torch.compile (no cast folded away: lo stays nonzero)."""
    t = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3e-5
    scale = fp16_scale(t)
    assert 2 ** 14 <= (t * scale).abs().max() < 2 ** 15
    for split in (split_fp16, torch.compile(split_fp16)):
        hi, lo = split(t * scale)
        assert hi.dtype == lo.dtype == torch.float16
        assert torch.equal(hi, (t * scale).half())
        error = ((hi.float() + lo.float()) / scale - t).abs().max() / t.abs().max()
        assert error < 2 ** -21, error
        assert (lo != 0).float().mean() > 0.9


def test_fp16_operand_scales_bring_every_operand_and_ds_into_fp16s_range():
    """softmax_bwd.fp16_operand_scales: each operand scaled into [2^14, 2^15), and dS
    (in the scaled units of dO and v) times s_ds below 2^14 and not far below it."""
    from vitattn_bwd import softmax_bwd
    from vitattn_bwd.layout import split_heads
    g = torch.Generator().manual_seed(1)
    B, H, S, D = 2, 3, 40, 16
    q, k, v = (torch.randn(B, H, S, D, generator=g) * m for m in (1e3, 1e-3, 7.0))
    grad_attn = torch.randn(B, S, H * D, generator=g) * 1e-6
    scales = softmax_bwd.fp16_operand_scales(grad_attn, q, k, v)
    assert scales.shape == (5,) and scales.dtype == torch.float32
    for t, t_scale in zip((grad_attn, q, k, v), scales):
        assert 2 ** 14 <= (t * t_scale).abs().max() < 2 ** 15
    p = torch.softmax(q @ k.transpose(-1, -2) * 8, -1)
    grad_p = split_heads(grad_attn, H) @ v.transpose(-1, -2)
    grad_s = p * (grad_p - (p * grad_p).sum(-1, keepdim=True))
    scaled = grad_s.abs().max() * scales[0] * scales[3] * scales[4]
    assert 2 ** 4 < scaled < 2 ** 14, scaled


@pytest.mark.parametrize("magnitudes", [(0, 1, 1, 1), (1, 0, 0, 1), (0, 0, 0, 0),
                                        (1e-36, 1, 1, 1e-30), (1e-30, 1e-30, 1e-30, 1e-30),
                                        (1e-25, 1e-20, 1e-20, 1e-20)],
                         ids=["dO zeros", "q k zeros", "all zeros", "dO below 2^-113",
                              "all 1e-30", "all tiny"])
def test_fp16_operand_scales_keep_the_kernels_products_of_scales_in_range(magnitudes):
    """What the Gluon fp16x3 kernels make of the scales (kernels/softmax_bwd_gluon.py, in
    their order: s_do * s_v, s_q * s_k, s_ds * (s_do * s_v) * s_q or s_k, 2^14 * s_do, and
    the reciprocals of those), finite and nonzero in float32 where operands are zeros or
    tiny: an all-zero dO had s_do = 2^127, s_do * s_v inf, and every gradient NaN on the
    GPU. Zero operands take scale 1; every operand stays in fp16's range once scaled."""
    from vitattn_bwd import softmax_bwd
    g = torch.Generator().manual_seed(3)
    B, H, S, D = 2, 3, 40, 16
    q, k, v = (torch.randn(B, H, S, D, generator=g) * m for m in magnitudes[1:])
    grad_attn = torch.randn(B, S, H * D, generator=g) * magnitudes[0]
    scales = softmax_bwd.fp16_operand_scales(grad_attn, q, k, v)
    s_do, s_q, s_k, s_v, s_ds = scales.unbind()
    grad_p_units = s_do * s_v
    for product in (grad_p_units, s_q * s_k, s_ds * grad_p_units * s_q,
                    s_ds * grad_p_units * s_k, 2.0 ** 14 * s_do):
        assert torch.isfinite(product) and product > 0 and torch.isfinite(1 / product)
    assert s_ds / 2.0 ** 14 > 0
    for t, t_scale in zip((grad_attn, q, k, v), scales[:4]):
        assert (t * t_scale).abs().max() < 2 ** 15
        if not t.any():
            assert t_scale == 1


def test_fp16_operand_scales_of_ordinary_operands_are_each_ones_own():
    """Where no product of scales nears float32's range, nothing is lowered: each scale
    is its operand's fp16_scale, and s_ds the bound's (gradients of a mean loss, 1e-9,
    included)."""
    from vitattn_bwd import softmax_bwd
    g = torch.Generator().manual_seed(4)
    B, H, S, D = 2, 3, 40, 16
    for magnitudes in ((1, 1, 1, 1), (1e-9, 1, 1, 1), (1e-7, 1e3, 1e-3, 7), (1e20, 1, 1, 1e-20)):
        q, k, v = (torch.randn(B, H, S, D, generator=g) * m for m in magnitudes[1:])
        grad_attn = torch.randn(B, S, H * D, generator=g) * magnitudes[0]
        scales = softmax_bwd.fp16_operand_scales(grad_attn, q, k, v)
        own = [fp16_scale(t) for t in (grad_attn, q, k, v)]
        assert torch.equal(scales[:4], torch.stack(own)), magnitudes
        row_norm = lambda t, s: torch.linalg.vector_norm(                  # noqa: E731
            (t * s).reshape(-1, D), dim=-1).amax()
        bound = 2 * row_norm(grad_attn, own[0]) * row_norm(v, own[3])
        assert scales[4] == power_of_two_scale(bound, 13), magnitudes


def test_operators_with_operand_scales_return_float32_gradients_and_check_them(
        monkeypatch):
    """The attention-core operators given operand_scales (fp16 halves): float32
    gradients, no halves, on the CPU as compiled; a malformed operand_scales is refused,
    naming it."""
    from vitattn_bwd import softmax_bwd
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)       # the float64 math
    g = torch.Generator().manual_seed(2)
    B, H, S, D = 1, 2, 9, 16
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    grad_attn = torch.randn(B, S, H * D, generator=g)
    probs = torch.softmax(torch.randn(B, H, S, S, generator=g), -1)
    scales = softmax_bwd.fp16_operand_scales(grad_attn, q, k, v)
    grad_q, grad_q_halves, delta, _ = softmax_bwd.softmax_bwd_rows(
        grad_attn, q, k, v, None, 0.25, FP16X3, probs, None, scales)
    grad_kv, grad_kv_halves, _ = softmax_bwd.softmax_bwd_cols(
        grad_attn, q, k, v, delta, 0.25, FP16X3, probs, None, scales)
    assert grad_q.dtype == grad_kv.dtype == torch.float32
    assert grad_q_halves.shape[-1] == grad_kv_halves.shape[-1] == 0
    want = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn, q, k, v)), 0.25, probs=probs.double())
    torch.testing.assert_close(grad_q.double(), want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_kv.double(), torch.cat(want[1:], -1), rtol=1e-6,
                               atol=1e-7)
    with pytest.raises(ValueError, match="operand_scales"):
        softmax_bwd.softmax_bwd_rows(grad_attn, q, k, v, None, 0.25, FP16X3, probs, None,
                                     scales[:4])
    with pytest.raises(ValueError, match="operand_scales"):
        softmax_bwd.softmax_bwd_cols(grad_attn, q.half(), k.half(), v.half(), delta, 0.25,
                                     FP16X3, probs, None, scales)
