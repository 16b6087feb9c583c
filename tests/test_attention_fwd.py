"""The attention forward operator (vitattn_bwd.attention_fwd): its PyTorch math against
float64, the recomputation of P from the log-sum-exp, the raw Triton kernel under the
interpreter, and properties over small shapes.

Precision, as normwise relative errors against float64 (inputs of standard deviation 1;
for lse the rms absolute error, i.e. the relative error it gives P):
  - PyTorch math in float32: ~3e-7 measured, bound FLOAT32_BOUND = 2e-6;
  - the kernel (bf16x3 products) under the interpreter, which truncates the bf16
    conversions where the GPU rounds: <= 3.4e-5 measured over S <= 100, bound
    INTERPRETER_BOUND = 1e-4 (tests/test_gpu_attention_fwd.py holds the GPU to 5e-5);
  - one plain bf16 product per matmul would be ~3e-3: every kernel test also asserts
    being 10x better than that, so a dropped lo term cannot pass.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from vitattn_bwd import attention_fwd as fwd

FLOAT32_BOUND = 2e-6
INTERPRETER_BOUND = 1e-4


def _qkv(B, H, S, D, seed=0, std=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=dtype) * std for _ in range(3)]


def _float64_reference(q, k, v, scale):
    """Textbook attention in float64: attn_output [B,S,E], lse [B,H,S], P [B,H,S,S]."""
    B, H, S, D = q.shape
    logits = scale * (q.double() @ k.double().transpose(-1, -2))          # [B,H,S,S]
    row_max = logits.amax(-1, keepdim=True)
    lse = (row_max + (logits - row_max).exp().sum(-1, keepdim=True).log()).squeeze(-1)
    P = torch.softmax(logits, dim=-1)
    attn_output = (P @ v.double()).transpose(1, 2).reshape(B, S, H * D)
    return attn_output, lse, P


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def _errors(q, k, v, scale, attn_output, lse):
    """Relative errors of attn_output and of P = exp(scale q k^T - lse) (float64), and
    the rms absolute error of lse, which is the relative error it gives P (an lse near 0
    would make a relative error of lse itself meaningless)."""
    want_output, want_lse, want_P = _float64_reference(q, k, v, scale)
    P = fwd.attention_probabilities(q.double(), k.double(), lse.double(), scale)
    lse_error = (lse.double() - want_lse).pow(2).mean().sqrt().item() if lse.numel() else 0
    return {"attn_output": _rel(attn_output, want_output), "lse": lse_error,
            "P": _rel(P, want_P)}


# ---- PyTorch math (the CPU path of the operator) -------------------------------------

@pytest.mark.parametrize("B,H,S,D", [(2, 3, 17, 8), (1, 1, 1, 4), (2, 2, 64, 16),
                                     (1, 2, 100, 48)])
def test_math_matches_float64(B, H, S, D):
    q, k, v = _qkv(B, H, S, D, seed=S)
    scale = 1.0 / math.sqrt(D)
    attn_output, lse = fwd.attention_math(q, k, v, scale)
    assert attn_output.shape == (B, S, H * D) and lse.shape == (B, H, S)
    for name, err in _errors(q, k, v, scale, attn_output, lse).items():
        assert err < FLOAT32_BOUND, (name, err)
    got64 = fwd.attention_math(*(t.double() for t in (q, k, v)), scale)
    for got, want in zip(got64, _float64_reference(q, k, v, scale)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("std", [1.0, 4.0])
def test_probabilities_from_lse_reproduce_softmax(std):
    """exp(scale q k^T - lse) in float32 is the softmax to float32 rounding, for the
    logits of unit inputs and for large ones (rows close to one-hot)."""
    q, k, v = _qkv(2, 2, 65, 32, seed=1, std=std)
    scale = 1.0 / math.sqrt(32)
    _, lse = fwd.attention_math(q, k, v, scale)
    P = fwd.attention_probabilities(q, k, lse, scale)
    want_P = _float64_reference(q, k, v, scale)[2]
    # rounding of logits of magnitude ~ std^2 * sqrt(D) * scale: ~1e-7 * std^2
    assert _rel(P, want_P) < 5e-7 * std ** 2
    torch.testing.assert_close(P.double().sum(-1), torch.ones_like(lse, dtype=torch.float64),
                               rtol=0, atol=1e-6 * std ** 2)


def test_operator_runs_the_math_on_cpu_and_passes_opcheck():
    q, k, v = _qkv(2, 2, 9, 8)
    attn_output, lse = fwd.attention_fwd(q, k, v, 0.3)
    want = fwd.attention_math(q, k, v, 0.3)
    assert torch.equal(attn_output, want[0]) and torch.equal(lse, want[1])
    torch.library.opcheck(fwd.attention_fwd, (q, k, v, 0.3))
    qkv = torch.randn(2, 9, 3 * 16)                  # heads of a QKV output: strided views
    q, k, v = (t.view(2, 9, 2, 8).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    torch.library.opcheck(fwd.attention_fwd, (q, k, v, 0.3))


def test_split_operator_equals_the_operator_on_the_split_values():
    """attention_fwd_split(hi, lo) of a QKV projection computes attention_fwd of the
    heads of hi + lo (here the CPU math; tests/test_gpu_attention_fwd.py the kernel)."""
    from vitattn_bwd.precision import split_bf16_truncated
    qkv = torch.randn(2, 9, 3 * 16, generator=torch.Generator().manual_seed(1))
    hi, lo = split_bf16_truncated(qkv)
    attn_output, lse = fwd.attention_fwd_split(hi, lo, 2, 0.3)
    q, k, v = ((hi.float() + lo.float())[..., i * 16:(i + 1) * 16].view(2, 9, 2, 8)
               .transpose(1, 2) for i in range(3))
    want = fwd.attention_fwd(q, k, v, 0.3)
    assert torch.equal(attn_output, want[0]) and torch.equal(lse, want[1])
    torch.library.opcheck(fwd.attention_fwd_split, (hi, lo, 2, 0.3))


@pytest.mark.parametrize("bad", ["shape", "dtype", "scale_zero", "scale_nan"])
def test_operator_rejects_bad_arguments(bad):
    q, k, v = _qkv(1, 2, 5, 8)
    scale = 0.3
    if bad == "shape":
        k = k[:, :, :4]
    elif bad == "dtype":
        v = v.double()
    else:
        scale = 0.0 if bad == "scale_zero" else float("nan")
    with pytest.raises(ValueError):
        fwd.attention_fwd(q, k, v, scale)


def test_empty_batch():
    q, k, v = _qkv(0, 2, 5, 16)
    for attn_output, lse in (fwd.attention_fwd(q, k, v, 0.25),
                             fwd.launch_attention_fwd(q, k, v, 0.25)):
        assert attn_output.shape == (0, 5, 32) and lse.shape == (0, 2, 5)


# ---- the Triton kernel under the interpreter -----------------------------------------

def assert_accurate(q, k, v, scale, attn_output, lse, bound):
    """Every error of the forward's outputs under `bound`, and attn_output 10x better than
    one bf16 product per matmul (the split must carry the low bits). Returns the errors."""
    errors = _errors(q, k, v, scale, attn_output, lse)
    for name, err in errors.items():
        assert err < bound, (name, err, errors)
    want_output = _float64_reference(q, k, v, scale)[0]
    bf16_output = _float64_reference(*(t.bfloat16().float() for t in (q, k, v)), scale)[0]
    assert errors["attn_output"] * 10 < _rel(bf16_output, want_output), errors
    return errors


def _check_kernel(q, k, v, scale, tiles=None, bound=INTERPRETER_BOUND):
    attn_output, lse = fwd.launch_attention_fwd(q, k, v, scale, tiles)
    assert_accurate(q, k, v, scale, attn_output, lse, bound)


def _tiles(block_m, block_n):
    return fwd.TileConfig(block_m, block_n, num_warps=4, num_stages=2)


# S across tile edges (one row, one short of / exactly / one past a tile, several tiles
# with a ragged last one); tiles that differ in M and N; S=100 with the default tiles.
@pytest.mark.parametrize("B,H,S,D,tiles", [
    (1, 1, 1, 16, _tiles(16, 16)), (2, 3, 15, 16, _tiles(16, 16)),
    (1, 2, 16, 32, _tiles(16, 16)), (2, 1, 17, 16, _tiles(16, 16)),
    (1, 3, 63, 16, _tiles(32, 16)), (2, 2, 64, 32, _tiles(32, 32)),
    (1, 2, 65, 64, _tiles(16, 32)), (1, 1, 100, 16, None),
    # head dims that are not powers of two (zero-padded tiles): 8 (a 16-wide tile),
    # SigLIP so400m's 72 and ViT-bigG's 104, three heads so that each has neighbours
    (2, 3, 17, 8, _tiles(16, 16)), (1, 3, 21, 72, _tiles(16, 16)),
    (1, 3, 19, 104, _tiles(16, 16))])
def test_kernel_matches_float64(triton_interpreter, B, H, S, D, tiles):
    q, k, v = _qkv(B, H, S, D, seed=S)
    _check_kernel(q, k, v, 1.0 / math.sqrt(D), tiles)


@pytest.mark.parametrize("D", [16, 80])
def test_kernel_reads_strided_views(triton_interpreter, D):
    """q, k, v as the module passes them (heads of one [B,S,3E] QKV output, split without
    a copy), and a key tensor whose last dim is not contiguous (copied first); at a power
    of two and at ViT-H/14's 80, whose padded tile reaches into the next head's columns
    (masked)."""
    B, S, H = 2, 33, 2
    qkv = torch.randn(B, S, 3 * H * D, generator=torch.Generator().manual_seed(3))
    q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    _check_kernel(q, k, v, 0.25, _tiles(16, 16))
    k_columns = k.transpose(-1, -2).contiguous().transpose(-1, -2)        # stride(-1) = S
    _check_kernel(q, k_columns, v, 0.25, _tiles(16, 16))


def test_kernel_with_large_logits(triton_interpreter):
    """Logits ~30x larger than unit inputs give, with keys growing in norm from tile to
    tile, a row max that rises in every tile (every rescale used) and near one-hot rows.
    Errors of P grow with the logits' magnitude (bf16x3 logits, ~1e-5 of it)."""
    B, H, S, D = 1, 2, 50, 16
    q, k, v = _qkv(B, H, S, D, seed=5, std=3.0)
    k = k * torch.linspace(0.5, 2.0, S)[:, None]
    _check_kernel(q, k, v, 1.0 / math.sqrt(D), _tiles(16, 16), bound=10 * INTERPRETER_BOUND)


# (the fixture only patches the interpreter once: safe to share between examples)
@settings(suppress_health_check=[HealthCheck.too_slow,
                                 HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 2), H=st.integers(1, 3), S=st.integers(1, 100),
       D=st.sampled_from([16, 32]), block_m=st.sampled_from([16, 32]),
       block_n=st.sampled_from([16, 32]), seed=st.integers(0, 2 ** 16))
def test_kernel_property_matches_float64(triton_interpreter, B, H, S, D, block_m,
                                         block_n, seed):
    q, k, v = _qkv(B, H, S, D, seed=seed)
    _check_kernel(q, k, v, 1.0 / math.sqrt(D), _tiles(block_m, block_n))
