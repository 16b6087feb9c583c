"""On a Hopper GPU: the Gluon attention-core kernels (softmax_bwd_gluon.py) against the
float64 math, P given and recomputed from its log-sum-exp, at every tile config
max-autotune may pick, at odd lengths; every output element written; bitwise
repeatable; the operators the compiled graph calls when a Gluon kernel wins; and the
head dims the kernels run in zero-padded tiles (SigLIP so400m's 72, ViT-H's 80,
ViT-bigG's 104, ...)."""
import math

import pytest
import torch

from vitattn_bwd import launcher, softmax_bwd, softmax_bwd_gluon
from vitattn_bwd.attention_fwd import attention_fwd_half
from vitattn_bwd.layout import merge_heads, split_heads
from vitattn_bwd.precision import Products, fused_products, split_bf16_rounded, split_fp16

from .helpers import jit_path_launch, recorded_jit_runs

pytestmark = pytest.mark.gpu
D = 64


@pytest.fixture(autouse=True)
def _hopper():
    if not softmax_bwd_gluon.available(torch.device("cuda"), torch.float32, D):
        pytest.skip("the Gluon kernels need a Hopper GPU and a Triton with Gluon")


def _given(p_or_lse, attn_output):
    """probs= or lse= for a case's first tensor: its log-sum-exp where the case has the
    forward's output (module mode), else P."""
    return dict(probs=p_or_lse) if attn_output is None else dict(lse=p_or_lse)


def _case(B, H, S, recompute, seed=0, head_dim=D):
    """(P or its log-sum-exp, grad_attn, q, k, v, attn_output (None with P), scale)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, head_dim, device="cuda", generator=g) for _ in range(3))
    grad_attn = torch.randn(B, S, H * head_dim, device="cuda", generator=g)
    scale = 1 / math.sqrt(head_dim)
    if recompute:
        logits = (q @ k.transpose(-1, -2)) * scale
        attn_output = merge_heads(torch.softmax(logits, -1) @ v)
        return torch.logsumexp(logits, -1), grad_attn, q, k, v, attn_output, scale
    probs = torch.softmax(torch.randn(B, H, S, S, device="cuda", generator=g), -1)
    return probs, grad_attn, q, k, v, None, scale


def _halves(grad_attn, q, k, v):
    return [part for t in (grad_attn, q, k, v) for part in split_bf16_rounded(t)]


def _run(p_or_lse, grad_attn, q, k, v, attn_output, scale, rows_tiles, cols_tiles):
    """Both passes into NaN-poisoned buffers: (grad_q16, grad_q_halves, delta,
    grad_q_sums, grad_kv16, grad_kv_halves, grad_kv_sums)."""
    B, H, S, head_dim = q.shape
    E = H * head_dim
    nan = dict(device="cuda", fill_value=float("nan"))
    delta = torch.full((B, H, S), **nan)
    grad_q_halves = torch.full((B, S, 2 * E), dtype=torch.bfloat16, **nan)
    grad_q16 = torch.full((B, S, E), dtype=torch.float16, **nan)
    grad_kv_halves = torch.full((B, S, 4 * E), dtype=torch.bfloat16, **nan)
    grad_kv16 = torch.full((B, S, 2 * E), dtype=torch.float16, **nan)
    groups = softmax_bwd.sum_groups(S)
    grad_q_sums = torch.full((B, groups, E), **nan)
    grad_kv_sums = torch.full((B, groups, 2 * E), **nan)
    halves = _halves(grad_attn, q, k, v)
    given = _given(p_or_lse, attn_output)
    softmax_bwd_gluon.launch_rows(*halves, p_or_lse if attn_output is None else attn_output,
                                  delta, grad_q_halves, grad_q_sums, grad_q16, scale,
                                  rows_tiles, **given)
    softmax_bwd_gluon.launch_cols(*halves, delta, grad_kv_halves, grad_kv_sums, grad_kv16,
                                  scale, cols_tiles, **given)
    return (grad_q16, grad_q_halves, delta, grad_q_sums, grad_kv16, grad_kv_halves,
            grad_kv_sums)


def _terms(p_or_lse, grad_attn, q, k, v, attn_output, scale):
    """(P * dP) k and (P * dP)^T q, times scale, and dV, in float64 [B,S,E]: the terms
    dQ and dK are differences of (dQ = that minus delta * P k, ...)."""
    p_or_lse, grad_attn, q, k, v = (t.double() for t in (p_or_lse, grad_attn, q, k, v))
    p = softmax_bwd.probabilities(q, k, scale,
                                  **_given(p_or_lse, attn_output))      # [B,H,S,S]
    grad_attn = split_heads(grad_attn, q.shape[1])                          # [B,H,S,D]
    p_grad_p = p * (grad_attn @ v.transpose(-1, -2))
    return (merge_heads(p_grad_p @ k * scale), merge_heads(p_grad_p.transpose(-1, -2) @ q
                                                          * scale),
            merge_heads(p.transpose(-1, -2) @ grad_attn))


def _float64(p_or_lse, grad_attn, q, k, v, attn_output, scale):
    return softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn, q, k, v)), scale,
        **_given(p_or_lse.double(), attn_output),
        attn_output=None if attn_output is None else attn_output.double())


@pytest.mark.parametrize("recompute", [False, True], ids=["P", "lse"])
@pytest.mark.parametrize("tiles", list(zip(softmax_bwd_gluon.ROWS_TILES, softmax_bwd_gluon.COLS_TILES)),
                         ids=lambda t: f"{tuple(t[0])}-{tuple(t[1])}")
@pytest.mark.parametrize("B,H,S", [(2, 16, 577), (1, 2, 1), (3, 1, 100), (1, 3, 64)])
def test_gluon_kernels_match_float64(recompute, tiles, B, H, S):
    case = _case(B, H, S, recompute)
    _assert_matches_float64(case, _run(*case, *tiles))


@pytest.mark.parametrize("recompute", [False, True], ids=["P", "lse"])
@pytest.mark.parametrize("B,H,S,head_dim", [(1, 16, 729, 72), (2, 16, 257, 80),
                                            (1, 3, 100, 104), (1, 3, 65, 8),
                                            (1, 2, 129, 128), (1, 3, 33, 40)])
def test_gluon_kernels_match_float64_at_every_head_dim(recompute, B, H, S, head_dim):
    """Head dims in zero-padded tiles of the next power of two (8 in 16; 40 in 64; 72,
    80 and 104 in 128), with each head between neighbours whose columns a padded tile
    covers, and 128 at its own tiles: as at 64, every output against float64."""
    case = _case(B, H, S, recompute, seed=head_dim, head_dim=head_dim)
    _assert_matches_float64(case, _run(*case, softmax_bwd_gluon.rows_tiles(head_dim)[0],
                                       softmax_bwd_gluon.cols_tiles(head_dim)[0]))


def _assert_matches_float64(case, outputs):
    """Every output of _run written and within bf16x3's error of the float64 math."""
    S = case[2].shape[2]
    grad_q16, grad_q_halves, delta, grad_q_sums, grad_kv16, grad_kv_halves, grad_kv_sums = (
        outputs)
    for out in outputs:
        assert not out.isnan().any()                       # every element written
    grad_q = softmax_bwd.float32_from_halves(grad_q_halves)
    grad_k, grad_v = softmax_bwd.float32_from_halves(grad_kv_halves).chunk(2, dim=-1)
    want = _float64(*case)
    # dQ and dK are sums of terms that cancel (to exactly 0 at one token): their errors
    # are measured against those terms' size, the terms the kernels add up
    scales = [max(w.norm().item(), t.norm().item()) for w, t in zip(want, _terms(*case))]
    errors = [(g.double() - w).norm().item() / scale
              for g, w, scale in zip((grad_q, grad_k, grad_v), want, scales)]
    assert max(errors) < 5e-5, errors                    # bf16x3: ~1e-5 measured
    # the fp16 copies are the same gradients, rounded to fp16
    torch.testing.assert_close(grad_q16.float(), grad_q, rtol=2e-3, atol=1e-3)
    torch.testing.assert_close(grad_kv16.float(), torch.cat([grad_k, grad_v], -1),
                               rtol=2e-3, atol=1e-3)
    # the partial sums over rows add up, per batch element, to the float64 gradients'
    # sums over rows (the QKV bias gradient), within the terms' size
    for sums, wants, terms in ((grad_q_sums, want[:1], scales[:1]),
                               (grad_kv_sums, want[1:], scales[1:])):
        for got_sum, w, scale in zip(sums.double().sum(1).chunk(len(wants), dim=-1), wants,
                                     terms):
            error = (got_sum - w.sum(1)).norm().item()
            assert error < 5e-5 * scale * math.sqrt(S), error


def _run_fp16_halves(p_or_lse, grad_attn, q, k, v, attn_output, scale, rows_tiles,
                     cols_tiles):
    """Both passes on scaled fp16 halves (precision "highest") into NaN-poisoned
    buffers: (grad_q [B,S,E], delta, grad_q_sums, grad_kv [B,S,2E], grad_kv_sums), the
    gradients float32."""
    B, H, S, _ = q.shape
    E = H * D
    nan = dict(device="cuda", fill_value=float("nan"))
    operand_scales = softmax_bwd.fp16_operand_scales(grad_attn, q, k, v)
    halves = [part for t, t_scale in zip((grad_attn, q, k, v), operand_scales)
              for part in split_fp16(t * t_scale)]
    no_halves = torch.empty(B, S, 0, dtype=torch.bfloat16, device="cuda")
    delta, grad_q = torch.full((B, H, S), **nan), torch.full((B, S, E), **nan)
    grad_kv = torch.full((B, S, 2 * E), **nan)
    groups = softmax_bwd.sum_groups(S)
    grad_q_sums, grad_kv_sums = (torch.full((B, groups, w), **nan) for w in (E, 2 * E))
    given = _given(p_or_lse, attn_output)
    softmax_bwd_gluon.launch_rows(*halves, p_or_lse if attn_output is None else attn_output,
                                  delta, no_halves, grad_q_sums, grad_q, scale, rows_tiles,
                                  Products.FP16X3, operand_scales=operand_scales, **given)
    softmax_bwd_gluon.launch_cols(*halves, delta, no_halves, grad_kv_sums, grad_kv, scale,
                                  cols_tiles, Products.FP16X3, operand_scales=operand_scales,
                                  **given)
    return grad_q, delta, grad_q_sums, grad_kv, grad_kv_sums


@pytest.mark.parametrize("recompute", [False, True], ids=["P", "lse"])
@pytest.mark.parametrize("tiles", list(zip(softmax_bwd_gluon.ROWS_TILES, softmax_bwd_gluon.COLS_TILES)),
                         ids=lambda t: f"{tuple(t[0])}-{tuple(t[1])}")
@pytest.mark.parametrize("B,H,S", [(2, 16, 577), (1, 2, 1), (3, 1, 100)])
def test_fp16_halves_kernels_are_float32_grade(recompute, tiles, B, H, S):
    """The fp16x3 kernels of precision "highest" on operands far from fp16's range (q at
    1e3, k at 1e-3, dO at 1e-7: the scales bring them in), against float64: every
    gradient, the partial sums and delta within 4e-6. What bounds them is the tensor
    cores' float32 accumulation, which truncates: 2.2e-6 measured at S = 577 and below
    1e-6 at S <= 100 on the H200, against ~1e-5 for bf16x3 (docs/performance.md,
    session 13)."""
    p_or_lse, grad_attn, q, k, v, attn_output, scale = _case(B, H, S, recompute, seed=5)
    # q k^T (so P, the log-sum-exp and the output) unchanged
    case = (p_or_lse, grad_attn * 1e-7, q * 1e3, k * 1e-3, v, attn_output, scale)
    outputs = _run_fp16_halves(*case, *tiles)
    for out in outputs:
        assert not out.isnan().any()                       # every element written
    grad_q, delta, grad_q_sums, grad_kv, grad_kv_sums = outputs
    want = _float64(*case)
    scales = [max(w.norm().item(), t.norm().item()) for w, t in zip(want, _terms(*case))]
    errors = [(g.double() - w).norm().item() / scale_
              for g, w, scale_ in zip((grad_q, *grad_kv.chunk(2, dim=-1)), want, scales)]
    assert max(errors) < 4e-6, errors
    for sums, wants, terms in ((grad_q_sums, want[:1], scales[:1]),
                               (grad_kv_sums, want[1:], scales[1:])):
        for got_sum, w, scale_ in zip(sums.double().sum(1).chunk(len(wants), dim=-1),
                                      wants, terms):
            assert (got_sum - w.sum(1)).norm().item() < 4e-6 * scale_ * math.sqrt(S)
    p_or_lse, grad_attn, q, k, v = (t.double() for t in case[:5])
    p = softmax_bwd.probabilities(q, k, scale, **_given(p_or_lse, attn_output))
    grad_p = split_heads(grad_attn, H) @ v.transpose(-1, -2)
    want_delta = (p * grad_p).sum(-1)
    assert ((delta.double() - want_delta).norm() / want_delta.norm()).item() < 4e-6


@pytest.mark.parametrize("recompute", [False, True], ids=["P", "lse"])
@pytest.mark.parametrize("magnitudes", [(0, 1, 1), (1, 0, 1), (1e-20, 1, 1e-15)],
                         ids=["dO zeros", "q zeros", "dO v tiny"])
def test_fp16_halves_kernels_with_zero_or_tiny_operands(recompute, magnitudes):
    """The fp16x3 kernels where an operand is all zeros (a loss term times 0 gives an
    all-zero dO; a zero-initialised projection zero q, k or v) or tiny: every output
    finite and as float64's (zeros where it is). An all-zero dO had scale 2^127, and the
    scales' products made every gradient NaN. dO at 1e-20 and v at 1e-15 need their
    scales lowered (2^79 * 2^62 would pass float32's range) while dK and dQ (~1e-35)
    stay float32 normals; at 1e-30 each the true dK and dQ (~1e-61) are below float32's
    range, and the kernels' zeros are right."""
    B, H, S = 2, 4, 100
    p_or_lse, grad_attn, q, k, v, attn_output, scale = _case(B, H, S, recompute, seed=6)
    do_m, q_m, v_m = magnitudes
    if recompute:          # the forward's output of the scaled v
        attn_output = attn_output * v_m
    case = (p_or_lse, grad_attn * do_m, q * q_m, k, v * v_m, attn_output, scale)
    if q_m == 0 and recompute:
        pytest.skip("q of zeros changes the log-sum-exp; P given covers it")
    grad_q, delta, _, grad_kv, _ = _run_fp16_halves(*case, softmax_bwd_gluon.ROWS_TILES[0],
                                                    softmax_bwd_gluon.COLS_TILES[0])
    for out in (grad_q, delta, grad_kv):
        assert torch.isfinite(out).all()
    want = _float64(*case)
    for got, w in zip((grad_q, *grad_kv.chunk(2, dim=-1)), want):
        error = (got.double() - w).norm().item()
        assert error <= 4e-6 * w.norm().item(), (error, w.norm().item())


def test_gluon_kernels_are_bitwise_repeatable():
    case = _case(2, 16, 577, recompute=False, seed=1)
    tiles = (softmax_bwd_gluon.ROWS_TILES[0], softmax_bwd_gluon.COLS_TILES[0])
    first, second = _run(*case, *tiles), _run(*case, *tiles)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("recompute", [False, True], ids=["P", "lse"])
def test_the_launch_cache_runs_what_the_jit_path_runs(monkeypatch, recompute):
    """Both passes three times through launcher.launch, each kernel's JIT path taken
    on its first call only, against the JIT path on every call: the same bits."""
    from vitattn_bwd.kernels.softmax_bwd_gluon import (softmax_bwd_cols_kernel,
                                                       softmax_bwd_rows_kernel)
    case = _case(2, 16, 577, recompute=recompute, seed=2)
    tiles = (softmax_bwd_gluon.ROWS_TILES[0], softmax_bwd_gluon.COLS_TILES[0])
    monkeypatch.setattr(launcher, "_compiled", {})
    rows_runs = recorded_jit_runs(monkeypatch, softmax_bwd_rows_kernel)
    cols_runs = recorded_jit_runs(monkeypatch, softmax_bwd_cols_kernel)
    cached = [_run(*case, *tiles) for _ in range(3)]
    assert (len(rows_runs), len(cols_runs)) == (1, 1)
    monkeypatch.setattr(launcher, "launch", jit_path_launch)
    jit = _run(*case, *tiles)
    bits = {4: torch.int32, 2: torch.int16}                  # NaN-poisoned buffers
    for outputs in cached:
        assert all(torch.equal(a.view(bits[a.element_size()]), b.view(bits[b.element_size()]))
                   for a, b in zip(outputs, jit))


@pytest.mark.parametrize("recompute", [False, True], ids=["P", "lse"])
def test_operators_of_the_compiled_graph(recompute):
    """gluon_softmax_bwd_rows / _cols, which the graph calls when max-autotune picks a
    Gluon kernel: the same outputs as the launchers into given buffers."""
    case = _case(2, 4, 577, recompute, seed=2)
    p_or_lse, grad_attn, q, k, v, attn_output, scale = case
    halves = _halves(grad_attn, q, k, v)
    rows_tiles, cols_tiles = softmax_bwd_gluon.ROWS_TILES[0], softmax_bwd_gluon.COLS_TILES[0]
    placeholder = p_or_lse if attn_output is None else attn_output
    probs, lse = (None, p_or_lse) if recompute else (p_or_lse, None)
    rows = torch.ops.vitattn_bwd.gluon_softmax_bwd_rows(probs, lse, *halves, placeholder,
                                                        scale, *rows_tiles, "bf16x3")
    cols = torch.ops.vitattn_bwd.gluon_softmax_bwd_cols(probs, lse, *halves, rows[2], scale,
                                                        *cols_tiles, "bf16x3")
    expected = _run(*case, rows_tiles, cols_tiles)
    got = (*rows, *cols)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _run_one_product(lse, grad_attn, q, k, v, attn_output, scale):
    """Both one-product passes on bf16 / fp16 operands into NaN-poisoned buffers:
    (grad_q, delta, grad_q_sums, grad_kv, grad_kv_sums)."""
    B, H, S, head_dim = q.shape
    E = H * head_dim
    nan = dict(device="cuda", fill_value=float("nan"))
    delta = torch.full((B, H, S), **nan)
    grad_q = torch.full((B, S, E), dtype=q.dtype, **nan)
    grad_kv = torch.full((B, S, 2 * E), dtype=q.dtype, **nan)
    groups = softmax_bwd.sum_groups(S)
    grad_q_sums = torch.full((B, groups, E), **nan)
    grad_kv_sums = torch.full((B, groups, 2 * E), **nan)
    operands = (grad_attn, grad_attn, q, q, k, k, v, v)          # lo is never read
    unused = torch.empty(0, device="cuda", dtype=torch.bfloat16)  # no halves
    softmax_bwd_gluon.launch_rows(*operands, attn_output, delta, unused, grad_q_sums, grad_q,
                                  scale, softmax_bwd_gluon.rows_tiles(head_dim)[0],
                                  products=fused_products(None, q.dtype), lse=lse)
    softmax_bwd_gluon.launch_cols(*operands, delta, unused, grad_kv_sums, grad_kv, scale,
                                  softmax_bwd_gluon.cols_tiles(head_dim)[0],
                                  products=fused_products(None, q.dtype), lse=lse)
    return grad_q, delta, grad_q_sums, grad_kv, grad_kv_sums


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,H,S,head_dim", [(2, 16, 577, D), (3, 2, 100, D), (1, 1, 1, D),
                                            (1, 16, 729, 72), (2, 3, 257, 80)])
def test_one_product_kernels_read_the_qkv_projection_where_it_lies(dtype, B, H, S,
                                                                   head_dim):
    """q, k, v as the head views of one QKV projection [B,S,3E] (the module's layout, row
    stride 3E, which the kernels read in place of contiguous copies): every output
    element written, bitwise the same as from contiguous copies, and the gradients
    within the half dtype's error of the float64 math; at 64 and at padded head dims."""
    g = torch.Generator(device="cuda").manual_seed(3)
    E = H * head_dim
    qkv = torch.randn(B, S, 3 * E, device="cuda", generator=g).to(dtype)
    q, k, v = (split_heads(t, H) for t in qkv.chunk(3, dim=-1))            # [B,H,S,D]
    grad_attn = torch.randn(B, S, E, device="cuda", generator=g).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    attn_output, lse = attention_fwd_half(q, k, v, scale)        # the block's forward
    attn_output = attn_output.contiguous()
    from_views = _run_one_product(lse, grad_attn, q, k, v, attn_output, scale)
    from_copies = _run_one_product(lse, grad_attn, q.contiguous(), k.contiguous(),
                                   v.contiguous(), attn_output, scale)
    for got, want in zip(from_views, from_copies):
        assert not got.isnan().any()
        assert torch.equal(got, want)
    grad_q, _, _, grad_kv, _ = from_views
    want = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn, q, k, v)), scale, lse=lse.double(),
        attn_output=attn_output.double())
    scales = [max(w.norm().item(), t.norm().item())
              for w, t in zip(want, _terms(lse, grad_attn, q, k, v, attn_output, scale))]
    errors = [(got.double() - w).norm().item() / s for got, w, s in
              zip((grad_q, *grad_kv.chunk(2, dim=-1)), want, scales)]
    assert max(errors) < 2e-2, errors             # bf16 one product: ~2.4e-3 measured


@pytest.mark.parametrize("recompute", [False, True], ids=["P", "lse"])
def test_a_batch_past_the_grid_rows_has_the_bits_of_one_launch(monkeypatch, recompute):
    """With MAX_GRID_ROWS cut to 2, 3 images of 2 heads launch one image at a time (at
    addresses the whole batch's launch does not have: lse's 520-byte images are not
    16-byte aligned); every output is bitwise what one launch writes."""
    case = _case(3, 2, 65, recompute)
    tiles = softmax_bwd_gluon.ROWS_TILES[0], softmax_bwd_gluon.COLS_TILES[0]
    whole = _run(*case, *tiles)
    monkeypatch.setattr(softmax_bwd_gluon, "MAX_GRID_ROWS", 2)
    for got, want in zip(_run(*case, *tiles), whole):
        assert torch.equal(got, want)
