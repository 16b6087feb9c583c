"""The attention-core operators: their outputs' formats, their PyTorch math (the CPU
path) and the raw Triton kernels under the interpreter, against the textbook softmax
backward in float64."""
import functools
import math

import pytest
import torch

from vitattn_bwd import reference, softmax_bwd
from vitattn_bwd.precision import Products, fused_products

from .helpers import relative_errors

BF16X3 = Products.BF16X3.value          # the operators' products for float operands


def _core_inputs(B, H, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(B, H, S, S, generator=g, dtype=dtype), dim=-1)
    grad_attn = torch.randn(B, S, H * D, generator=g, dtype=dtype)
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=dtype) for _ in range(3))
    return P, grad_attn, q, k, v, 1.0 / math.sqrt(D)


def _textbook(P, grad_attn, q, k, v, scale):
    H = P.shape[1]
    grads = reference.softmax_attention_backward(
        P.double(), reference.split_heads(grad_attn.double(), H), q.double(), k.double(),
        v.double(), scale)
    return [reference.merge_heads(g) for g in grads]                  # dQ, dK, dV [B,S,E]


@pytest.mark.parametrize("B,H,S,D", [(2, 3, 17, 8), (1, 1, 1, 4), (2, 2, 64, 16)])
def test_plain_math_equals_textbook_backward(B, H, S, D):
    P, grad_attn, q, k, v, scale = _core_inputs(B, H, S, D, dtype=torch.float64)
    got = softmax_bwd.attention_backward_math(grad_attn, q, k, v, scale, probs=P)
    for g, want in zip(got, _textbook(P, grad_attn, q, k, v, scale)):
        torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)


def test_operators_write_fp16_copies_and_bf16_halves():
    """Outside Triton (here: a head dim the kernels do not take, under the interpreter)
    the operators round float64 math to the formats the graph's GEMMs read: fp16
    gradients, and [hi | lo] bf16 halves whose sum keeps ~16 mantissa bits."""
    P, grad_attn, q, k, v, scale = _core_inputs(2, 3, 17, 4)
    grad_q16, grad_q_halves, delta, grad_q_sums = softmax_bwd.softmax_bwd_rows(
        grad_attn, q, k, v, None, scale, BF16X3, probs=P)
    grad_kv16, grad_kv_halves, grad_kv_sums = softmax_bwd.softmax_bwd_cols(
        grad_attn, q, k, v, delta, scale, BF16X3, probs=P)
    assert (grad_q16.dtype, grad_q_halves.dtype, grad_kv16.dtype) == (
        torch.float16, torch.bfloat16, torch.float16)
    assert grad_q_halves.shape == (2, 17, 24) and grad_kv_halves.shape == (2, 17, 48)
    want_q, want_k, want_v = _textbook(P, grad_attn, q, k, v, scale)
    want_kv = torch.cat([want_k, want_v], dim=-1)
    for halves, want in ((grad_q_halves, want_q), (grad_kv_halves, want_kv)):
        err = (softmax_bwd.float32_from_halves(halves).double() - want).abs()
        assert (err <= 2 ** -16 * want.abs() + 1e-12).all()
    for copy16, want in ((grad_q16, want_q), (grad_kv16, want_kv)):
        assert torch.equal(copy16, want.half())                # round to nearest fp16
    # partial sums over rows: [B, cdiv(17, 16), N], adding up to the bias gradient
    for sums, want in ((grad_q_sums, want_q), (grad_kv_sums, want_kv)):
        assert sums.dtype == torch.float32 and sums.shape == (2, 2, want.shape[-1])
        torch.testing.assert_close(sums.double().sum((0, 1)), want.sum((0, 1)),
                                   rtol=1e-6, atol=1e-6)
    want_delta = (P * (reference.split_heads(grad_attn, 3) @ v.transpose(-1, -2))).sum(-1)
    torch.testing.assert_close(delta, want_delta, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_operators_of_half_precision_operands(dtype):
    """bf16 / fp16 operands (the module's one-product path, with the log-sum-exp): the
    gradients in the operands' dtype, rounded once from the math on their values, empty
    halves, float32 partial sums and delta."""
    P, grad_attn, q, k, v, scale = _core_inputs(2, 3, 17, 8)
    q, k, v, grad_attn = (t.to(dtype) for t in (q, k, v, grad_attn))
    lse, attn_output = _log_sum_exp_and_output(q.double(), k.double(), v.double(), scale)
    attn_output = attn_output.to(dtype)
    products = fused_products(None, dtype).value
    grad_q, grad_q_halves, delta, grad_q_sums = softmax_bwd.softmax_bwd_rows(
        grad_attn, q, k, v, attn_output, scale, products, lse=lse.float())
    grad_kv, grad_kv_halves, grad_kv_sums = softmax_bwd.softmax_bwd_cols(
        grad_attn, q, k, v, delta, scale, products, lse=lse.float())
    assert grad_q.dtype == grad_kv.dtype == dtype
    assert grad_q_halves.shape == (2, 17, 0) and grad_kv_halves.shape == (2, 17, 0)
    assert delta.dtype == grad_q_sums.dtype == grad_kv_sums.dtype == torch.float32
    # (the rows pass takes delta from attn_output, the cols pass's math from P and dP)
    operands = (grad_attn.double(), q.double(), k.double(), v.double())
    lse64 = lse.float().double()
    want_q = softmax_bwd.attention_backward_math(*operands, scale, lse=lse64,
                                                 attn_output=attn_output.double())[0]
    _, want_k, want_v = softmax_bwd.attention_backward_math(*operands, scale, lse=lse64)
    for got, want in ((grad_q, want_q), (grad_kv, torch.cat([want_k, want_v], dim=-1))):
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)
    torch.library.opcheck(softmax_bwd.softmax_bwd_rows,
                          (grad_attn, q, k, v, attn_output, scale, products, None,
                           lse.float()))
    torch.library.opcheck(softmax_bwd.softmax_bwd_cols,
                          (grad_attn, q, k, v, delta, scale, products, None, lse.float()))


def test_operators_pass_opcheck():
    P, grad_attn, q, k, v, scale = _core_inputs(2, 2, 9, 8)
    _, _, delta, _ = softmax_bwd.softmax_bwd_rows(grad_attn, q, k, v, None, scale, BF16X3,
                                                  probs=P)
    torch.library.opcheck(softmax_bwd.softmax_bwd_rows,
                          (grad_attn, q, k, v, None, scale, BF16X3, P))
    torch.library.opcheck(softmax_bwd.softmax_bwd_cols,
                          (grad_attn, q, k, v, delta, scale, BF16X3, P))
    lse, attn_output = _log_sum_exp_and_output(q, k, v, scale)
    torch.library.opcheck(softmax_bwd.softmax_bwd_rows,
                          (grad_attn, q, k, v, attn_output, scale, BF16X3, None, lse))


# odd lengths, a single row, a length that is a multiple of the blocks, and block shapes
# that differ between the two passes
@pytest.mark.parametrize("S,D,block_m,block_n", [(37, 16, 16, 16), (1, 16, 16, 16),
                                                 (64, 32, 32, 16), (23, 16, 16, 32)])
def test_triton_kernels_under_interpreter(triton_interpreter, S, D, block_m, block_n):
    B, H = 2, 2
    P, grad_attn, q, k, v, scale = _core_inputs(B, H, S, D, seed=S)
    got = softmax_bwd.attention_backward(grad_attn, q, k, v, scale, probs=P,
                                         block_m=block_m, block_n=block_n)
    want = _textbook(P, grad_attn, q, k, v, scale)
    # bf16x3: ~1e-5 on the GPU; the interpreter truncates where the GPU rounds. Errors
    # are measured against the larger of the output's and dV's norms: at S = 1, dQ = dK = 0
    # exactly and the kernel leaves rounding of terms as large as dV.
    for name, g, w in zip(("grad_q", "grad_k", "grad_v"), got, want):
        err = (g.double() - w).norm().item()
        assert err <= 2e-4 * max(w.norm().item(), want[2].norm().item()), (name, err)
    # one bf16 product per matmul would be ~100x worse: the split carries the low bits
    bf16 = _textbook(*(t.bfloat16().float() for t in (P, grad_attn, q, k, v)), scale)
    if S > 1:
        assert relative_errors(got[2:], want[2:])[0] * 10 < relative_errors(bf16[2:], want[2:])[0]


@pytest.mark.parametrize("D,recompute_p", [(8, False), (72, False), (104, True)])
def test_kernels_at_head_dims_that_are_not_powers_of_two(triton_interpreter, D,
                                                         recompute_p):
    """Head dims the kernels run in zero-padded tiles of the next power of two (8 in a
    16-wide tile; SigLIP so400m's 72 and ViT-bigG's 104 in 128-wide ones), three heads
    so that each has neighbours whose columns a padded tile covers: every output of
    both passes (the fp16 copies, the bf16 halves, the partial sums, delta) matches
    float64, so no padding column is written over a neighbour's."""
    B, H, S = 1, 3, 21
    P, lse, attn_output, grad_attn, q, k, v, scale = _softmax_inputs(B, H, S, D, seed=D)
    given, output = (dict(lse=lse), attn_output) if recompute_p else (dict(probs=P), None)
    grad_q16, grad_q_halves, delta, grad_q_sums = softmax_bwd.launch_rows(
        grad_attn, q, k, v, output, scale, **given, block_m=16, block_n=32)
    grad_kv16, grad_kv_halves, grad_kv_sums = softmax_bwd.launch_cols(
        grad_attn, q, k, v, delta, scale, **given, block_m=32, block_n=16)
    want_q, want_k, want_v = _textbook(P, grad_attn, q, k, v, scale)
    want_kv = torch.cat([want_k, want_v], dim=-1)                         # [B,S,2E]
    for copy16, halves, sums, want in ((grad_q16, grad_q_halves, grad_q_sums, want_q),
                                       (grad_kv16, grad_kv_halves, grad_kv_sums, want_kv)):
        scale_of = want.norm().item()
        assert (softmax_bwd.float32_from_halves(halves).double() - want).norm() \
            <= 2e-4 * scale_of
        assert (copy16.double() - want).norm() <= 2e-3 * scale_of      # fp16 rounding
        assert (sums.double().sum(1) - want.sum(1)).norm() <= 2e-4 * scale_of
    want_delta = (P.double() * (reference.split_heads(grad_attn.double(), H)
                                @ v.double().transpose(-1, -2))).sum(-1)
    torch.testing.assert_close(delta.double(), want_delta, rtol=1e-4, atol=1e-4)


def test_kernels_fp16_copies_match_their_halves(triton_interpreter):
    """The kernels' two output formats describe the same gradient."""
    P, grad_attn, q, k, v, scale = _core_inputs(1, 2, 21, 16, seed=5)
    grad_q16, grad_q_halves, delta, _ = softmax_bwd.launch_rows(grad_attn, q, k, v, None,
                                                                scale, probs=P)
    grad_kv16, grad_kv_halves, _ = softmax_bwd.launch_cols(grad_attn, q, k, v, delta,
                                                           scale, probs=P)
    for copy16, halves in ((grad_q16, grad_q_halves), (grad_kv16, grad_kv_halves)):
        value = softmax_bwd.float32_from_halves(halves)
        assert ((copy16.float() - value).abs() <= 2 ** -10 * value.abs() + 1e-6).all()


@pytest.mark.parametrize("block", [16, 32, 64])
def test_kernels_partial_sums_add_up_to_the_bias_gradient(triton_interpreter, block):
    """Each program writes the sum over its rows (rows past S left out) into the first
    16-row group it owns and zeros into the others (up to the last group: a 64-row
    program covers all 37 rows, groups 0-3, of which group 3 does not exist); summed over
    groups, per batch element, they are the gradients' sums over rows."""
    S = 37                                                 # 3 groups, the last partial
    P, grad_attn, q, k, v, scale = _core_inputs(2, 2, S, 16, seed=8)
    _, grad_q_halves, delta, grad_q_sums = softmax_bwd.launch_rows(
        grad_attn, q, k, v, None, scale, probs=P, block_m=block, block_n=block)
    _, grad_kv_halves, grad_kv_sums = softmax_bwd.launch_cols(
        grad_attn, q, k, v, delta, scale, probs=P, block_m=block, block_n=block)
    for sums, halves in ((grad_q_sums, grad_q_halves), (grad_kv_sums, grad_kv_halves)):
        grad = softmax_bwd.float32_from_halves(halves).double()          # [B,S,N]
        assert sums.shape == (2, 3, grad.shape[-1])
        torch.testing.assert_close(sums.double().sum(1), grad.sum(1), rtol=1e-5,
                                   atol=1e-5 * grad.abs().sum(1).max().item())
        if block > 16:                        # group 1 (rows 16-31): zeros of program 0
            assert torch.equal(sums[:, 1], torch.zeros_like(sums[:, 1]))
        if block == 64:                       # and group 2 (rows 32-36) too
            assert torch.equal(sums[:, 2], torch.zeros_like(sums[:, 2]))
        if block < 64:                        # group 2 holds the sum of rows 32-36
            torch.testing.assert_close(sums[:, 2].double(), grad[:, 32:].sum(1), rtol=1e-5,
                                       atol=1e-5 * grad.abs().sum(1).max().item())


def _log_sum_exp_and_output(q, k, v, scale):
    """What the module's forward saves for the core: lse [B,H,S] and O [B,S,E], computed
    in float64 and rounded to q's dtype."""
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    attn_output = reference.merge_heads(torch.softmax(logits, -1) @ v.double())
    return torch.logsumexp(logits, -1).to(q.dtype), attn_output.to(q.dtype)


def _softmax_inputs(B, H, S, D, seed):
    """q, k, v, the P they make and P given the module's way: its log-sum-exp and O."""
    _, grad_attn, q, k, v, scale = _core_inputs(B, H, S, D, seed=seed)
    logits = (q @ k.transpose(-1, -2)) * scale
    lse, attn_output = _log_sum_exp_and_output(q, k, v, scale)
    return torch.softmax(logits, -1), lse, attn_output, grad_attn, q, k, v, scale


def test_math_recomputes_p_from_its_log_sum_exp():
    _, grad_attn, q, k, v, scale = _core_inputs(2, 2, 13, 8, dtype=torch.float64, seed=3)
    logits = (q @ k.transpose(-1, -2)) * scale
    lse, attn_output = _log_sum_exp_and_output(q, k, v, scale)
    given = softmax_bwd.attention_backward_math(grad_attn, q, k, v, scale,
                                                probs=torch.softmax(logits, -1))
    recomputed = softmax_bwd.attention_backward_math(grad_attn, q, k, v, scale, lse=lse,
                                                     attn_output=attn_output)
    for a, b in zip(given, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_module_mode_delta_comes_from_the_forward_output():
    """With lse, the rows operator's delta is rowsum(dO * O) of the O it is given (not
    rowsum(P * dP)): an O off by 1% moves delta by 1% and dQ with it."""
    _, grad_attn, q, k, v, scale = _core_inputs(2, 2, 13, 8, dtype=torch.float64, seed=4)
    lse, attn_output = _log_sum_exp_and_output(q, k, v, scale)
    heads = reference.split_heads
    want = (heads(grad_attn, 2) * heads(attn_output, 2)).sum(-1)          # [B,H,S]
    _, _, delta, _ = softmax_bwd.softmax_bwd_rows(grad_attn, q, k, v, attn_output, scale,
                                                  BF16X3, lse=lse)
    torch.testing.assert_close(delta, want.float(), rtol=1e-6, atol=1e-6)
    _, _, shifted, _ = softmax_bwd.softmax_bwd_rows(grad_attn, q, k, v, attn_output * 1.01,
                                                    scale, BF16X3, lse=lse)
    torch.testing.assert_close(shifted, (want * 1.01).float(), rtol=1e-6, atol=1e-6)


def test_log_sum_exp_without_the_forward_output_is_refused():
    """lse needs attn_output: a clear error, not delta from garbage."""
    _, grad_attn, q, k, v, scale = _core_inputs(1, 2, 9, 8, seed=6)
    lse, _ = _log_sum_exp_and_output(q, k, v, scale)
    for rows in (functools.partial(softmax_bwd.softmax_bwd_rows, products=BF16X3),
                 softmax_bwd.launch_rows):
        with pytest.raises(ValueError, match="attn_output"):
            rows(grad_attn, q, k, v, None, scale, lse=lse)


def test_probs_and_lse_exactly_one_is_given():
    """Both P and its log-sum-exp, or neither, or either of the wrong rank: a ValueError
    naming them, from the operators, their fake implementations, the launchers and the
    compiled graph's entry point."""
    P, grad_attn, q, k, v, scale = _core_inputs(1, 2, 9, 8, seed=6)
    lse, attn_output = _log_sum_exp_and_output(q, k, v, scale)
    delta = torch.zeros(1, 2, 9)
    calls = [lambda **given: softmax_bwd.softmax_bwd_rows(grad_attn, q, k, v, attn_output,
                                                          scale, BF16X3, **given),
             lambda **given: softmax_bwd.launch_rows(grad_attn, q, k, v, attn_output, scale,
                                                     **given),
             lambda **given: softmax_bwd.softmax_bwd_cols(grad_attn, q, k, v, delta, scale,
                                                          BF16X3, **given),
             lambda **given: softmax_bwd.launch_cols(grad_attn, q, k, v, delta, scale,
                                                     **given)]
    for call in calls:
        for given, message in ((dict(probs=P, lse=lse), "exactly one of probs .* got both"),
                               ({}, "exactly one of probs .* got neither"),
                               (dict(probs=lse), "probs must be 4-D"),
                               (dict(lse=P), "lse must be 3-D")):
            with pytest.raises(ValueError, match=message):
                call(**given)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (P, grad_attn, q, k, v, lse, attn_output)]
        with pytest.raises(ValueError, match="got both"):
            softmax_bwd.softmax_bwd_rows(*fake[1:5], fake[6], scale, BF16X3,
                                         probs=fake[0], lse=fake[5])
    # and the graph's entry point, before any compile
    from vitattn_bwd import graph
    for given, message in ((dict(probs=P, lse=lse), "got both"), ({}, "got neither")):
        with pytest.raises(ValueError, match=f"compiled_backward: .*{message}"):
            graph.compiled_backward(dict(x=grad_attn, **given), scale=scale, norm_eps=1e-5,
                                    ln_grad="exact", products=Products.PLAIN)


def test_rows_kernel_takes_delta_from_the_forward_output(triton_interpreter):
    """RECOMPUTE_P: the kernel's delta is rowsum(dO * O) of the O it is given; an O off by
    1% moves it by 1% (so the kernel does not sum P * dP instead)."""
    _, grad_attn, q, k, v, scale = _core_inputs(1, 2, 21, 16, seed=7)
    lse, attn_output = _log_sum_exp_and_output(q, k, v, scale)
    heads = reference.split_heads
    want = (heads(grad_attn.double(), 2) * heads(attn_output.double(), 2)).sum(-1)
    for factor in (1.0, 1.01):
        _, _, delta, _ = softmax_bwd.launch_rows(grad_attn, q, k, v, attn_output * factor,
                                                 scale, lse=lse, block_m=16, block_n=16)
        torch.testing.assert_close(delta.double(), want * factor, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("S,block_m,block_n", [(37, 16, 32), (1, 16, 16), (64, 32, 16)])
def test_kernels_recompute_p_under_interpreter(triton_interpreter, S, block_m, block_n):
    """RECOMPUTE_P: the kernels read lse [B,H,S] instead of P, and take delta from the
    attention output, and match the textbook."""
    P, lse, attn_output, grad_attn, q, k, v, scale = _softmax_inputs(2, 2, S, 16, seed=S)
    got = softmax_bwd.attention_backward(grad_attn, q, k, v, scale, lse=lse,
                                         attn_output=attn_output, block_m=block_m,
                                         block_n=block_n)
    want = _textbook(P, grad_attn, q, k, v, scale)
    for name, g, w in zip(("grad_q", "grad_k", "grad_v"), got, want):
        err = (g.double() - w).norm().item()
        assert err <= 2e-4 * max(w.norm().item(), want[2].norm().item()), (name, err)
