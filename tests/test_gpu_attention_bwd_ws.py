"""The warp-specialized one-pass attention-core backward (attention_bwd_ws.py) on a
Hopper GPU: dQ, dK, dV against float64 within twice the error of SDPA's own flash
backward on the same inputs, at token counts that leave a partial query tile and a
partial key block (and one key block alone), bitwise the same on every call and from
QKV views as from contiguous copies."""
import math

import pytest
import torch

from vitattn_bwd import attention_bwd_ws, launcher, softmax_bwd
from vitattn_bwd.attention_fwd import attention_fwd_half
from vitattn_bwd.layout import merge_heads

from .helpers import jit_path_launch, recorded_jit_runs

pytestmark = pytest.mark.gpu

HEAD_DIM = 64
SCALE = 1 / math.sqrt(HEAD_DIM)


@pytest.fixture(autouse=True)
def hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel needs a Hopper GPU")


def _inputs(batch, heads, seq_len, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, seq_len, 3 * heads * HEAD_DIM, device="cuda", generator=g)
    q, k, v = (t.unflatten(-1, (heads, HEAD_DIM)).transpose(1, 2)
               for t in qkv.to(dtype).chunk(3, dim=-1))                      # [B,H,S,D]
    grad_attn = torch.randn(batch, seq_len, heads * HEAD_DIM, device="cuda",
                            generator=g).to(dtype)
    attn_output, lse = attention_fwd_half(q, k, v, SCALE)
    return q, k, v, grad_attn, attn_output.contiguous(), lse


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _flash_backward(q, k, v, grad_attn):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=SCALE)
    grad_out = grad_attn.view(q.shape[0], q.shape[2], q.shape[1], HEAD_DIM).transpose(1, 2)
    return [merge_heads(g) for g in torch.autograd.grad(out, (q, k, v), grad_out)]


@pytest.mark.parametrize("tiles", attention_bwd_ws.TILES + attention_bwd_ws.CANDIDATE_TILES)
@pytest.mark.parametrize("seq_len, dtype", [(577, torch.bfloat16), (577, torch.float16),
                                            (100, torch.bfloat16), (200, torch.bfloat16),
                                            (2, torch.bfloat16)])
def test_gradients_against_float64(tiles, seq_len, dtype):
    q, k, v, grad_attn, attn_output, lse = _inputs(2, 3, seq_len, dtype, seed=seq_len)
    ref = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn, q, k, v)), SCALE, lse=lse.double())
    grad_qkv = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE, tiles)
    got = grad_qkv.chunk(3, dim=-1)                                  # dQ | dK | dV
    flash = _flash_backward(q, k, v, grad_attn)
    for name, g, f, r in zip(("dQ", "dK", "dV"), got, flash, ref):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        assert _rel(g, r) <= 2 * _rel(f, r) + 1e-4, (name, _rel(g, r), _rel(f, r))


@pytest.mark.parametrize("tiles", attention_bwd_ws.TILES[:1] + attention_bwd_ws.CANDIDATE_TILES[:1])
def test_bitwise_reproducible(tiles):
    """Three calls, and the QKV views against contiguous copies: the same bits (dQ is
    added in key-block order, never by racing atomics)."""
    q, k, v, grad_attn, attn_output, lse = _inputs(4, 16, 577, torch.bfloat16, seed=7)
    first = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE, tiles)
    for _ in range(2):
        again = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE, tiles)
        assert torch.equal(first, again)
    copies = attention_bwd_ws.launch(q.contiguous(), k.contiguous(), v.contiguous(),
                                     grad_attn, attn_output, lse, SCALE, tiles)
    assert torch.equal(first, copies)


@pytest.mark.parametrize("batch, seq_len", [(1, 577), (3, 100), (2, 16)])
def test_the_launch_cache_runs_what_the_jit_path_runs(monkeypatch, batch, seq_len):
    """launcher.launch's cached compiled kernels against triton's JIT path on every
    call: the same bits, with lse 16-byte aligned and not. The JIT path runs once per
    specialization: the main kernel once, the delta kernel, which reads lse, once for
    each alignment; every other launch comes from the cache."""
    from vitattn_bwd.kernels.attention_bwd_ws import (attention_bwd_ws_kernel,
                                                      attention_delta_kernel)
    q, k, v, grad_attn, attn_output, lse = _inputs(batch, 16, seq_len, torch.bfloat16,
                                                   seed=seq_len)
    misaligned_lse = torch.empty(lse.numel() + 1, device="cuda")[1:].view_as(lse)
    misaligned_lse.copy_(lse)
    monkeypatch.setattr(launcher, "_compiled", {})
    main_runs = recorded_jit_runs(monkeypatch, attention_bwd_ws_kernel)
    delta_runs = recorded_jit_runs(monkeypatch, attention_delta_kernel)
    cached = [(lse_in, [attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse_in,
                                                SCALE) for _ in range(3)])
              for lse_in in (lse, misaligned_lse)]
    assert (len(main_runs), len(delta_runs)) == (1, 2)
    monkeypatch.setattr(launcher, "launch", jit_path_launch)
    for lse_in, grads in cached:
        jit = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse_in, SCALE)
        assert all(torch.equal(grad, jit) for grad in grads)


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("programs", [None, 8])
def test_persistent_programs_walk_many_items_to_the_same_bits(programs, rotated):
    """Batch 12 x 16 heads: 960 (head, key block) items walked by one program per SM
    (about 7 items each on a 132-SM GPU) or by 8 (120 each), each program's ring, k / v
    tiles, dQ buffers and barriers carried from item to item: the same bits as one
    program per item, or with the rotated walk as 5 programs, one per key block of a
    head (the adds' order is the semaphores', not the schedule's), and as close to
    float64 as SDPA's flash backward's."""
    tiles = attention_bwd_ws.FASTEST_TILES if rotated else next(
        t for t in attention_bwd_ws.CANDIDATE_TILES if t.persistent and not t.rotated_walk)
    q, k, v, grad_attn, attn_output, lse = _inputs(12, 16, 577, torch.bfloat16, seed=12)
    walked = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE, tiles,
                                     programs=programs)
    if rotated:
        other = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE, tiles,
                                        programs=5)
    else:
        other = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE,
                                        tiles._replace(persistent=False))
    assert torch.equal(walked, other)
    q1, k1, v1 = (t[:1] for t in (q, k, v))                 # float64 at batch 1 (memory)
    ref = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn[:1], q1, k1, v1)), SCALE, lse=lse[:1].double())
    flash = _flash_backward(q1, k1, v1, grad_attn[:1])
    got = walked[:1].chunk(3, dim=-1)
    for name, g, f, r in zip(("dQ", "dK", "dV"), got, flash, ref):
        assert _rel(g, r) <= 2 * _rel(f, r) + 1e-4, (name, _rel(g, r), _rel(f, r))


def test_the_longest_sequence_the_rotated_walk_takes():
    """One head of 128 tokens per SM (a key block per program: the rotated walk's limit,
    attention_bwd_ws.fits), as close to float64 as SDPA's flash backward; one token
    more is refused before any launch."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    seq_len = 128 * sm_count
    assert attention_bwd_ws.fits(1, 1, seq_len, sm_count)
    assert not attention_bwd_ws.fits(1, 1, seq_len + 1, sm_count)
    q, k, v, grad_attn, attn_output, lse = _inputs(1, 1, seq_len, torch.bfloat16, seed=3)
    grad_qkv = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE)
    ref = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn, q, k, v)), SCALE, lse=lse.double())
    flash = _flash_backward(q, k, v, grad_attn)
    for name, g, f, r in zip(("dQ", "dK", "dV"), grad_qkv.chunk(3, dim=-1), flash, ref):
        assert _rel(g, r) <= 2 * _rel(f, r) + 1e-4, (name, _rel(g, r), _rel(f, r))
    del ref
    q, k, v, grad_attn, attn_output, lse = _inputs(1, 1, seq_len + 1, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="^a rotated walk needs at least as many programs"):
        attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE)


def test_more_heads_than_one_grid_dimension_holds():
    """B * H = 65,600 (heads) past the 65,535 limit of a grid's second and third
    dimensions, 64 tokens each: the last images' gradients as close to float64 as SDPA's
    flash backward's, and the same bits as those images alone."""
    tiles = attention_bwd_ws.FASTEST_TILES
    q, k, v, grad_attn, attn_output, lse = _inputs(4100, 16, 64, torch.bfloat16, seed=5)
    grad_qkv = attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE, tiles)
    last = slice(-2, None)
    q2, k2, v2 = (t[last] for t in (q, k, v))
    alone = attention_bwd_ws.launch(q2, k2, v2, grad_attn[last], attn_output[last],
                                    lse[last].contiguous(), SCALE, tiles)
    assert torch.equal(grad_qkv[last], alone)
    ref = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn[last], q2, k2, v2)), SCALE,
        lse=lse[last].double())
    flash = _flash_backward(q2, k2, v2, grad_attn[last])
    for name, g, f, r in zip(("dQ", "dK", "dV"), grad_qkv[last].chunk(3, dim=-1), flash,
                             ref):
        assert _rel(g, r) <= 2 * _rel(f, r) + 1e-4, (name, _rel(g, r), _rel(f, r))
