"""Hypothesis strategies, input builders, float64 references, error bounds and a runner
shared by the property tests: tests/test_properties.py (CPU: Triton interpreter, the
compiled CPU path, the module on the CPU), tests/test_stateful.py (CPU) and
tests/test_gpu_properties.py (gpu). Entry points covered: the attention core's eager
launchers with P or with its log-sum-exp (module mode), the fused attention forward, the
whole backward (attention_block_backward) and VisionAttentionBlock's forward + backward.

Error measure: ||out - ref|| / ||ref|| with ref computed in float64 from the same
float32 inputs. The bounds come from the precision map, stated next to each number.
"""
import dataclasses
import math
import time

import torch
from hypothesis import HealthCheck, Phase, example, given, reject, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

import vitattn_bwd
from vitattn_bwd import VisionAttentionBlock, reference
from vitattn_bwd import attention_fwd as fwd
from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs

from . import plants
from .test_attention_fwd import assert_accurate

# ---------------------------------------------------------------------------------------
# Bounds (relative to the output's norm, against float64)
# ---------------------------------------------------------------------------------------

# Attention core on the GPU. dV = P^T dO, dP = dO V^T and dQ: "bf16x3" (three bf16
# products, float32 accumulation, ~1e-5 relative) -> 5e-5. dK = dS^T Q: ONE fp16 product
# (round-to-nearest fp16 operands, float32 accumulation, ~3e-4) -> 1e-3.
CORE_BOUNDS_GPU = {"grad_q": 5e-5, "grad_k": 1e-3, "grad_v": 5e-5}
# Under the Triton interpreter bf16 conversions truncate where the GPU rounds (about 2x
# the error of a rounded split, plus a bias): 2e-4 for the bf16x3 outputs, 2e-3 for dK.
CORE_BOUNDS_INTERPRETER = {"grad_q": 2e-4, "grad_k": 2e-3, "grad_v": 2e-4}
CORE_OUTPUTS = ("grad_q", "grad_k", "grad_v")

# Compiled whole backward on the GPU: bf16x3 GEMMs, 1e-4. grad_qkv_weight is one fp16
# GEMM: 1e-3. grad_x, grad_ln_weight, grad_ln_bias come from grad_x_norm = grad_qkv @
# qkv_weight, which carries dK's fp16 error: 1e-3. grad_qkv_bias: its K third is exactly
# zero in exact arithmetic (the sum over keys of dS is zero per row), so what is left there
# is dK's rounding (~3e-4 of the norm of dK's column sums): 1e-3 as well.
BLOCK_BOUNDS_GPU = {name: 1e-4 for name in OUTPUT_NAMES}
BLOCK_BOUNDS_GPU.update(grad_qkv_weight=1e-3, grad_x=1e-3, grad_ln_weight=1e-3,
                        grad_ln_bias=1e-3, grad_qkv_bias=1e-3)
# Compiled path on the CPU: plain float32 products (1e-5), float64 (1e-12).
BLOCK_BOUNDS_CPU = {torch.float32: 1e-5, torch.float64: 1e-12}

# Logits recomputed by the kernels (the forward, and the attention core in module mode:
# P = exp(scale q k^T - lse)) are bf16x3 products of q and k split by truncation
# (split_bf16_truncated, made by PyTorch: the same splits on the GPU and under the
# interpreter). The dropped lo*lo products (~2^-16 of each product q_d k_d, biased) and
# the rounding of lo leave an absolute error in each logit proportional to
# Lambda = scale * sqrt(D) * rms(q) * rms(k) (the logits' standard deviation for
# unrelated q and k; `logit_scale`), and P = exp(logit - lse) carries that absolute error
# as a relative one. Measured under the interpreter over Lambda 0.2-23 (scale up to 2,
# head_dim up to 128; 150 draws each): the forward's P and lse, and the module-mode
# gradients (dQ, dK measured against their cancelled terms, as core_errors does), grow
# by at most 2.5e-5 per unit of Lambda (5.6e-4 at Lambda 22.5). Bounds add LOGIT_SLOPE *
# Lambda, twice that. (Where P is given, the logits are not recomputed: no such term.)
LOGIT_SLOPE = 5e-5

# The fused forward (attention_fwd): attn_output and P = exp(scale q k^T - lse) as
# relative errors, lse as its rms absolute error (the relative error it gives P); the
# bounds of tests/test_attention_fwd.py and tests/test_gpu_attention_fwd.py (at
# Lambda ~ 1: interpreter 1e-4, measured <= 3.4e-5; GPU 5e-5, bf16x3 with rounded
# in-register splits) plus LOGIT_SLOPE * Lambda. check_fwd also asserts attn_output 10x
# closer to float64 than one bf16 product per matmul.
FWD_BOUND_INTERPRETER = 1e-4
FWD_BOUND_GPU = 5e-5

# VisionAttentionBlock: the forward's y and the gradients of x and of each parameter,
# against float64 autograd through reference.block_forward. On the GPU the backward is
# the compiled path (BLOCK_BOUNDS_GPU, by the output each gradient is) fed by the fused
# forward's attn_output and lse (FWD_BOUND_GPU + LOGIT_SLOPE * Lambda on top); y is
# eager float32 LayerNorm and Linears (TF32 off, ~1e-6) around the forward kernel:
# FWD_BOUND_GPU (+ LOGIT_SLOPE * Lambda). On the CPU everything is plain float32 /
# float64 math: BLOCK_BOUNDS_CPU.
MODULE_PARAMS = ("norm.weight", "norm.bias", "qkv.weight", "qkv.bias", "out_proj.weight",
                 "out_proj.bias")
MODULE_OUTPUTS = ("y", "x") + MODULE_PARAMS          # y, then the gradients
MODULE_GRAD_IS = {"x": "grad_x", "norm.weight": "grad_ln_weight",
                  "norm.bias": "grad_ln_bias", "qkv.weight": "grad_qkv_weight",
                  "qkv.bias": "grad_qkv_bias", "out_proj.weight": "grad_out_weight",
                  "out_proj.bias": "grad_out_bias"}


def module_bounds_gpu(logit_scale):
    extra = FWD_BOUND_GPU + LOGIT_SLOPE * logit_scale
    return {"y": extra, **{name: BLOCK_BOUNDS_GPU[block] + extra
                           for name, block in MODULE_GRAD_IS.items()}}


def module_bounds_cpu(dtype):
    return dict.fromkeys(MODULE_OUTPUTS, BLOCK_BOUNDS_CPU[dtype])


def logit_scale(q, k, scale):
    """Lambda: scale * sqrt(D) * rms(q) * rms(k), the size of the logits scale q k^T and
    of their absolute rounding error in units of the products' (see LOGIT_SLOPE)."""
    def rms(t):
        return t.double().pow(2).mean().sqrt().item() if t.numel() else 0.0
    return scale * math.sqrt(q.shape[-1]) * rms(q) * rms(k)

# ---------------------------------------------------------------------------------------
# Shapes and layouts
# ---------------------------------------------------------------------------------------

HEAD_DIMS = (16, 32, 64, 128)   # the unpadded head tiles; the kernels take every multiple
                                # of 8 up to 128 (padded dims: fixed cases in the tests)
TILE_SIZES = (16, 32, 64, 128)
TILE_EDGES = tuple(sorted({t + d for t in TILE_SIZES for d in (-1, 0, 1)}))
# contiguous; "offset": a view into a larger flat buffer at an odd element offset (4-byte,
# not 16-byte, aligned); "transposed": dims 1 and 2 swapped in storage (q, k, v held
# sequence-major as a fused QKV projection gives them); "strided": every other element of
# the last dim; "padded": rows of a wider buffer (a pitch of n + odd, like qkv.chunk(3)).
# Gaps and margins of the larger buffers hold NaN: a kernel that reads outside the view
# returns NaN, which the finite check and the error bound catch.
LAYOUTS = ("contiguous", "offset", "transposed", "strided", "padded")


def seq_lens(max_len, min_len=1):
    """Any length in [min_len, max_len], with 1, 2 and the tile edges (16, 32, 64, 128
    and each +-1) drawn often."""
    edges = [s for s in (1, 2) + TILE_EDGES if min_len <= s <= max_len]
    return st.one_of(st.sampled_from(edges), st.integers(min_len, max_len))


def scales(head_dim):
    return st.one_of(st.just(1.0 / math.sqrt(head_dim)),
                     st.floats(0.01, 2.0, allow_nan=False, allow_infinity=False))


def place(t, layout, offset=1):
    """A tensor with t's values held in `layout` (see LAYOUTS); a fresh allocation."""
    nan = float("nan")
    if layout == "contiguous":
        out = t.clone()
    elif layout == "offset":
        buf = torch.full((t.numel() + offset + 3,), nan, dtype=t.dtype, device=t.device)
        out = buf[offset:offset + t.numel()].view(t.shape)
        out.copy_(t)
    elif layout == "transposed":
        out = t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() >= 3 else \
            t.t().contiguous().t() if t.dim() == 2 else t.clone()
    elif layout == "strided":
        buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), nan, dtype=t.dtype,
                         device=t.device)
        out = buf[..., ::2]
        out.copy_(t)
    elif layout == "padded":
        buf = torch.full((*t.shape[:-1], t.shape[-1] + offset), nan, dtype=t.dtype,
                         device=t.device)
        out = buf[..., offset:]
        out.copy_(t)
    else:
        raise ValueError(layout)
    assert torch.equal(out, t)
    return out


# ---------------------------------------------------------------------------------------
# The attention core: attention_backward(grad_attn, q, k, v, scale, probs= or lse=,
# attn_output=, block_m=, block_n=)
# ---------------------------------------------------------------------------------------

# the first entry's layout is lse's where the core gets lse instead of P
CORE_TENSORS = ("probs", "grad_attn", "q", "k", "v")
# Where P comes from. "random": softmax(randn); "qk": softmax(q k^T / sqrt(D)) (P given,
# the contract's mode); "lse": the core gets the log-sum-exp of scale q k^T [B,H,S]
# instead of P and recomputes P = exp(scale q k^T - lse) (module mode,
# VisionAttentionBlock's backward).
P_SOURCES = ("random", "qk")


@dataclasses.dataclass(frozen=True)
class CoreCase:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    scale: float
    seed: int
    p_source: str                # "random", "qk" or "lse" (see P_SOURCES)
    layouts: tuple               # one per CORE_TENSORS entry
    offset: int                  # element offset / row padding of "offset"/"padded"
    block_m: int | None = None   # None: the launcher's default tiles
    block_n: int | None = None


def shapes(draw, max_seq, max_heads, max_batch, max_batch_heads, head_dims):
    """(B, H, S, D) drawn for the attention kernels; B * H <= max_batch_heads if given."""
    S = draw(seq_lens(max_seq))
    D = draw(st.sampled_from(head_dims))
    H = draw(st.integers(1, max_heads))
    most_batch = max_batch if max_batch_heads is None else max(1, min(max_batch,
                                                                       max_batch_heads // H))
    return draw(st.integers(1, most_batch)), H, S, D


@st.composite
def core_cases(draw, *, max_seq, max_heads, max_batch, max_batch_heads=None,
               head_dims=HEAD_DIMS, tiles=(None,), layouts=LAYOUTS, p_sources=P_SOURCES):
    B, H, S, D = shapes(draw, max_seq, max_heads, max_batch, max_batch_heads, head_dims)
    return CoreCase(
        batch=B, heads=H, seq_len=S, head_dim=D, scale=draw(scales(D)),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        p_source=draw(st.sampled_from(p_sources)),
        layouts=tuple(draw(st.sampled_from(layouts)) for _ in CORE_TENSORS),
        offset=draw(st.sampled_from([1, 3, 5, 7, 33])),
        block_m=draw(st.sampled_from(tiles)), block_n=draw(st.sampled_from(tiles)))


def core_inputs(case, device):
    """(logical, placed): the inputs as contiguous float32 tensors, and the same values in
    the case's layouts (what the kernel gets). probs is P [B,H,S,S], or for p_source
    "lse" instead lse, the float32 log-sum-exp [B,H,S] of the float64 scale q k^T, with
    the attention output O [B,S,E] that goes with it (as grad_attn is laid out)."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    B, H, S, D = case.batch, case.heads, case.seq_len, case.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    q, k, v = randn(B, H, S, D), randn(B, H, S, D), randn(B, H, S, D)
    grad_attn = randn(B, S, H * D)
    extra = {}
    if case.p_source == "lse":
        logits = case.scale * (q.double() @ k.double().transpose(-1, -2))
        extra["lse"] = torch.logsumexp(logits, dim=-1).float()
        extra["attn_output"] = reference.merge_heads(                  # O [B,S,E]
            torch.softmax(logits, dim=-1) @ v.double()).float()
    elif case.p_source == "qk":
        logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
        extra["probs"] = torch.softmax(logits, dim=-1).float()
    else:
        extra["probs"] = torch.softmax(randn(B, H, S, S), dim=-1)
    logical = dict(grad_attn=grad_attn, q=q, k=k, v=v, **extra)
    layouts = dict(zip(CORE_TENSORS, case.layouts), lse=case.layouts[0],
                   attn_output=case.layouts[1])
    placed = {name: place(t, layouts[name], case.offset) for name, t in logical.items()}
    return logical, placed


def core_probabilities(logical, scale):
    """float64 P [B,H,S,S] the gradients are taken for: P as given, or where the core
    gets a log-sum-exp, the exact softmax(scale q k^T) of the float32 q and k."""
    if "probs" in logical:
        return logical["probs"].double()
    q, k = logical["q"].double(), logical["k"].double()
    return torch.softmax(scale * (q @ k.transpose(-1, -2)), dim=-1)


def core_reference(probs, grad_attn, q, k, v, scale):
    """float64 textbook softmax backward: grad_q, grad_k, grad_v [B,S,E]."""
    H = probs.shape[1]
    grads = reference.softmax_attention_backward(
        probs.double(), reference.split_heads(grad_attn.double(), H), q.double(),
        k.double(), v.double(), scale)
    return [reference.merge_heads(g) for g in grads]


def cancelled_terms(probs, logical, scale):
    """dQ = scale ((P*dP) K - delta * (P K)) and dK = scale ((P*dP)^T Q - (P*delta)^T Q)
    are differences of terms that the kernels round (and, in module mode, recompute P
    for) separately: the norms of the first terms, scale (P*dP) K and scale (P*dP)^T Q
    [B,S,E], against which a residue is measured where they cancel. probs: float64 P.
    At seq_len 1 (P = 1, dQ = dK = 0 exactly) they are scale (dO . v) k and
    scale (dO . v) q."""
    H = probs.shape[1]
    grad_p = (reference.split_heads(logical["grad_attn"].double(), H)
              @ logical["v"].double().transpose(-1, -2))                   # [B,H,S,S]
    weighted = probs * grad_p
    return [reference.merge_heads(scale * (w @ logical[name].double())).norm().item()
            for w, name in ((weighted, "k"), (weighted.transpose(-1, -2), "q"))]


def core_errors(got, want, seq_len, terms=(0.0, 0.0)):
    """Relative errors of grad_q, grad_k, grad_v. dQ and dK are differences of terms
    that a kernel rounds separately (`terms`, see cancelled_terms), so they are measured
    against the larger of their norm and those terms (the kernels' rounding scales with
    the terms): at 100-577 tokens the terms are 1.0-1.2x the norm, but a few tokens
    leave a difference several times smaller than its terms (2 tokens: median 2.3x,
    up to 64x over 200 seeds; docs/runs/one_off/core_cancelled_terms_cpu.txt), and in
    module mode (P recomputed without renormalizing its rows) a row close to one-hot
    much smaller (the relative error of P, times those terms, is left). At seq_len 1,
    dQ = dK = 0 exactly and a kernel leaves rounding of the cancelled terms and of
    terms as large as dV: measured against the largest of the three."""
    errors = {}
    for index, (name, g, w) in enumerate(zip(CORE_OUTPUTS, got, want)):
        denom = w.norm().item()
        if name != "grad_v":
            denom = max(denom, terms[index])
            if seq_len == 1:
                denom = max(denom, want[2].norm().item())
        errors[name] = (g.double() - w).norm().item() / max(denom, 1e-300)
    return errors


def core_bounds(case, logical, bounds):
    """The case's bounds: `bounds` for P given; in module mode each plus LOGIT_SLOPE *
    Lambda (the recomputed P's error)."""
    if case.p_source != "lse":
        return bounds
    extra = LOGIT_SLOPE * logit_scale(logical["q"], logical["k"], case.scale)
    return {name: bound + extra for name, bound in bounds.items()}


def check_core(case, device, bounds, attention_backward):
    """One example of the attention-core property: attention_backward on the case's
    layouts against float64, inputs untouched, outputs float32 [B,S,E] and finite."""
    logical, placed = core_inputs(case, device)
    before = {name: t.clone() for name, t in placed.items()}
    got = attention_backward(*(placed[n] for n in CORE_TENSORS[1:]), case.scale,
                             probs=placed.get("probs"), lse=placed.get("lse"),
                             attn_output=placed.get("attn_output"), block_m=case.block_m,
                             block_n=case.block_n)
    probs = core_probabilities(logical, case.scale)
    want = core_reference(probs, *(logical[n] for n in CORE_TENSORS[1:]), case.scale)
    for name in placed:
        assert torch.equal(placed[name], before[name]), f"{name} was modified"
    for name, g, w in zip(CORE_OUTPUTS, got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape, (name, g.dtype, g.shape)
        assert torch.isfinite(g).all(), f"{name} has NaN/Inf"
    errors = core_errors(got, want, case.seq_len,
                         cancelled_terms(probs, logical, case.scale))
    bounds = core_bounds(case, logical, bounds)
    for name, err in errors.items():
        assert err <= bounds[name], (name, err, bounds[name], case)
    return errors


# ---------------------------------------------------------------------------------------
# The fused attention forward: attention_fwd(q, k, v, scale) -> attn_output, lse
# ---------------------------------------------------------------------------------------

FWD_TENSORS = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class FwdCase:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    scale: float
    seed: int
    layouts: tuple               # one per FWD_TENSORS entry
    offset: int
    tiles: tuple | None = None   # (block_m, block_n) for the launcher; None: defaults


@st.composite
def fwd_cases(draw, *, max_seq, max_heads, max_batch, max_batch_heads=None,
              head_dims=HEAD_DIMS, tiles=(None,), layouts=LAYOUTS):
    B, H, S, D = shapes(draw, max_seq, max_heads, max_batch, max_batch_heads, head_dims)
    return FwdCase(
        batch=B, heads=H, seq_len=S, head_dim=D, scale=draw(scales(D)),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        layouts=tuple(draw(st.sampled_from(layouts)) for _ in FWD_TENSORS),
        offset=draw(st.sampled_from([1, 3, 5, 7, 33])), tiles=draw(st.sampled_from(tiles)))


def fwd_tile_config(tiles):
    """(block_m, block_n) -> the launcher's TileConfig (4 warps, 2 stages: small tiles
    that fit any head dim's shared memory)."""
    return None if tiles is None else fwd.TileConfig(*tiles, num_warps=4, num_stages=2)


def public_attention_fwd(q, k, v, scale, tiles=None):
    """The forward as VisionAttentionBlock runs it: the operator (vitattn_bwd::attention_fwd)
    on CUDA with its default tiles; the eager launcher where tiles are given, and on the
    CPU (Triton's interpreter; the operator itself runs PyTorch math there). Both look
    launch_attention_fwd up at each call, so a plant that replaces it is the one run."""
    if q.device.type == "cuda" and tiles is None:
        return fwd.attention_fwd(q, k, v, scale)
    return fwd.launch_attention_fwd(q, k, v, scale, fwd_tile_config(tiles))


def fwd_inputs(case, device):
    """(logical, placed) q, k, v: standard normal float32 [B,H,S,D], and the same values
    in the case's layouts."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    shape = (case.batch, case.heads, case.seq_len, case.head_dim)
    logical = {name: torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
               for name in FWD_TENSORS}
    placed = {name: place(logical[name], layout, case.offset)
              for name, layout in zip(FWD_TENSORS, case.layouts)}
    return logical, placed


def check_fwd(case, device, bound, attention_fwd):
    """One example of the forward property: attention_fwd(q, k, v, scale, tiles) on the
    case's layouts against float64 softmax attention (tests/test_attention_fwd.py's
    errors: attn_output, lse, and P recomputed from lse), each within bound + LOGIT_SLOPE
    * Lambda, attn_output 10x closer than one bf16 product per matmul; inputs untouched,
    outputs float32 [B,S,E] and [B,H,S], finite."""
    logical, placed = fwd_inputs(case, device)
    before = {name: t.clone() for name, t in placed.items()}
    attn_output, lse = attention_fwd(*(placed[n] for n in FWD_TENSORS), case.scale,
                                     case.tiles)
    for name in FWD_TENSORS:
        assert torch.equal(placed[name], before[name]), f"{name} was modified"
    B, H, S, D = case.batch, case.heads, case.seq_len, case.head_dim
    for name, t, shape in (("attn_output", attn_output, (B, S, H * D)),
                           ("lse", lse, (B, H, S))):
        assert t.dtype == torch.float32 and t.shape == shape, (name, t.dtype, t.shape)
        assert torch.isfinite(t).all(), f"{name} has NaN/Inf"
    q, k, v = (logical[n] for n in FWD_TENSORS)
    limit = bound + LOGIT_SLOPE * logit_scale(q, k, case.scale)
    return assert_accurate(q, k, v, case.scale, attn_output, lse, limit)


# ---------------------------------------------------------------------------------------
# The whole backward: vitattn_bwd.attention_block_backward (compiled path)
# ---------------------------------------------------------------------------------------

BLOCK_TENSORS = ("grad_output", "x", "x_mean", "x_var", "x_norm", "ln_weight", "qkv_weight",
                 "q", "k", "v", "attn_weights", "attn_output", "out_weight")


@dataclasses.dataclass(frozen=True)
class BlockCase:
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    ln_grad: str
    seed: int
    scale: float
    norm_eps: float
    layouts: tuple                # one per BLOCK_TENSORS entry
    offset: int = 1
    dtype: torch.dtype = torch.float32


@st.composite
def block_cases(draw, *, seqs, max_heads, head_dims, max_batch, layouts=LAYOUTS,
                dtypes=(torch.float32,), batches=None):
    S = draw(seqs)
    D = draw(st.sampled_from(head_dims))
    H = draw(st.integers(1, max_heads))
    B = draw(batches if batches is not None else st.integers(1, max_batch))
    return BlockCase(
        batch=B, seq_len=S, heads=H, head_dim=D,
        ln_grad=draw(st.sampled_from(["exact", "contract"])),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        scale=draw(st.sampled_from([1.0 / math.sqrt(D), 0.37])),
        norm_eps=draw(st.sampled_from([1e-5, 1e-3])),
        layouts=tuple(draw(st.sampled_from(layouts)) for _ in BLOCK_TENSORS),
        offset=draw(st.sampled_from([1, 3, 5])),
        dtype=draw(st.sampled_from(dtypes)))


# One layout per BLOCK_TENSORS entry, every kind of LAYOUTS among them: the layouts of
# the properties' explicit examples.
MIXED_BLOCK_LAYOUTS = ("offset", "contiguous", "strided", "padded", "transposed", "offset",
                       "transposed", "transposed", "strided", "offset", "transposed",
                       "padded", "transposed")


def public_block_backward(*args, **kwargs):
    """vitattn_bwd.attention_block_backward, looked up at each call (so that a plant that
    replaces it is the one called)."""
    return vitattn_bwd.attention_block_backward(*args, **kwargs)


def block_inputs(case, device):
    """(logical, placed) dicts of the 15 inputs (make_inputs' distribution)."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    logical = make_inputs(case.batch, seq_len=case.seq_len,
                          embed_dim=case.heads * case.head_dim, num_heads=case.heads,
                          device=device, dtype=case.dtype, generator=g)
    logical.update(scale=case.scale, norm_eps=case.norm_eps)
    placed = dict(logical)
    for name, layout in zip(BLOCK_TENSORS, case.layouts):
        placed[name] = place(logical[name], layout, case.offset)
    return logical, placed


def block_reference(logical, num_heads, ln_grad, device):
    args = {n: (t.to(device=device, dtype=torch.float64) if torch.is_tensor(t) else t)
            for n, t in logical.items()}
    with torch.no_grad():
        return reference.attention_block_backward(**args, num_heads=num_heads,
                                                  ln_grad=ln_grad)


def relative_error(out, ref):
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check_block(case, device, bounds, backward):
    """One example of the compiled-path property: backward(**placed) (the public API's
    signature) against float64, inputs untouched, outputs finite and not aliasing inputs.
    bounds: {output name: bound}."""
    logical, placed = block_inputs(case, device)
    tensors = {n: t for n, t in placed.items() if torch.is_tensor(t)}
    before = {n: t.clone() for n, t in tensors.items()}
    grads = backward(**placed, num_heads=case.heads, ln_grad=case.ln_grad)
    refs = block_reference(logical, case.heads, case.ln_grad, device)
    for name, t in tensors.items():
        assert torch.equal(t, before[name]), f"{name} was modified"
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    errors = {}
    for name, out, ref in zip(OUTPUT_NAMES, grads, refs):
        assert out.dtype == case.dtype and out.shape == ref.shape, (name, out.dtype)
        assert out.untyped_storage().data_ptr() not in storages, f"{name} aliases an input"
        assert torch.isfinite(out).all(), f"{name} has NaN/Inf"
        errors[name] = relative_error(out, ref)
        assert errors[name] <= bounds[name], (name, errors[name], bounds[name], case)
    return errors


# ---------------------------------------------------------------------------------------
# The module: VisionAttentionBlock forward and backward
# ---------------------------------------------------------------------------------------

MODULE_TENSORS = ("x", "grad_y")


@dataclasses.dataclass(frozen=True)
class ModuleCase:
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    eps: float
    seed: int
    qkv_gain: float               # qkv.weight ~ N(0, gain^2 / E): logits of size ~gain^2
    layouts: tuple                # one per MODULE_TENSORS entry
    offset: int = 1
    dtype: torch.dtype = torch.float32


@st.composite
def module_cases(draw, *, seqs, max_heads, head_dims, batches, layouts=LAYOUTS,
                 dtypes=(torch.float32,)):
    D = draw(st.sampled_from(head_dims))
    return ModuleCase(
        batch=draw(batches), seq_len=draw(seqs), heads=draw(st.integers(1, max_heads)),
        head_dim=D, eps=draw(st.sampled_from([1e-5, 1e-6, 1e-3])),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        qkv_gain=draw(st.sampled_from([0.5, 1.0, 2.0])),
        layouts=tuple(draw(st.sampled_from(layouts)) for _ in MODULE_TENSORS),
        offset=draw(st.sampled_from([1, 3, 5])), dtype=draw(st.sampled_from(dtypes)))


def module_inputs(case, device):
    """(block, logical, placed): a VisionAttentionBlock with parameters drawn from the
    case's seed (LayerNorm weight 1 + N(0, 0.01), biases N(0, 0.01), out_proj.weight
    N(0, 1/E), qkv.weight N(0, qkv_gain^2/E)), and x, grad_y [B,S,E] standard normal, as
    contiguous tensors and in the case's layouts."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    E = case.heads * case.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=case.dtype)

    block = VisionAttentionBlock(E, case.heads, eps=case.eps, device=device,
                                 dtype=case.dtype)
    with torch.no_grad():
        block.norm.weight.copy_(1 + 0.1 * randn(E))
        block.norm.bias.copy_(0.1 * randn(E))
        block.qkv.weight.copy_(randn(3 * E, E) * (case.qkv_gain / math.sqrt(E)))
        block.qkv.bias.copy_(0.1 * randn(3 * E))
        block.out_proj.weight.copy_(randn(E, E) / math.sqrt(E))
        block.out_proj.bias.copy_(0.1 * randn(E))
    shape = (case.batch, case.seq_len, E)
    logical = {name: randn(*shape) for name in MODULE_TENSORS}
    placed = {name: place(logical[name], layout, case.offset)
              for name, layout in zip(MODULE_TENSORS, case.layouts)}
    return block, logical, placed


def module_reference(block, x, grad_y):
    """float64 autograd through the stock block (reference.block_forward, SDPA) on the
    same values: ([y, grad_x, grad of each parameter], Lambda of its q and k)."""
    params = [p.detach().double().requires_grad_() for p in block.parameters()]
    x64 = x.detach().double().requires_grad_()
    y64 = reference.block_forward(x64, *params, num_heads=block.num_heads, eps=block.eps)
    grads = torch.autograd.grad(y64, [x64, *params], grad_y.double())
    with torch.no_grad():
        E = x.shape[-1]
        x_norm = torch.nn.functional.layer_norm(x64, (E,), params[0], params[1], block.eps)
        q, k, _ = torch.nn.functional.linear(x_norm, params[2], params[3]).chunk(3, dim=-1)
    D = E // block.num_heads
    return [y64.detach(), *grads], logit_scale(q, k, 1.0 / math.sqrt(D))


def check_module(case, device, bounds):
    """One example of the module property: y = block(x) and the gradients of x and of the
    six parameters for grad_y (x and grad_y in the case's layouts) against float64
    autograd through the stock block; x and grad_y untouched; y and every gradient in its
    tensor's dtype and shape, finite, not sharing x's memory. bounds: a dict by
    MODULE_OUTPUTS name, or a function of Lambda returning one."""
    block, logical, placed = module_inputs(case, device)
    before = {name: t.clone() for name, t in placed.items()}
    x = placed["x"].requires_grad_()
    y = block(x)
    got = [y.detach(), *torch.autograd.grad(y, [x, *block.parameters()], placed["grad_y"])]
    want, lam = module_reference(block, logical["x"], logical["grad_y"])
    bounds = bounds(lam) if callable(bounds) else bounds
    for name in MODULE_TENSORS:
        assert torch.equal(placed[name].detach(), before[name]), f"{name} was modified"
    x_storage = x.untyped_storage().data_ptr()
    assert y.untyped_storage().data_ptr() != x_storage, "y aliases x"
    errors = {}
    for name, out, ref in zip(MODULE_OUTPUTS, got, want):
        assert out.dtype == case.dtype and out.shape == ref.shape, (name, out.dtype)
        assert torch.isfinite(out).all(), f"{name} has NaN/Inf"
        errors[name] = relative_error(out, ref)
        assert errors[name] <= bounds[name], (name, errors[name], bounds[name], case)
    return errors


# ---------------------------------------------------------------------------------------
# Running a property with bounded examples and time
# ---------------------------------------------------------------------------------------

# name -> {"examples": run, "rejected_over_budget": n, "seconds": s, "max_errors": {...},
#          "plant": the planted error's name or None, "failed": True where it failed}
RUN_STATS = {}


def run_property(name, check, strategy, *, explicit=(), budget_s=None, **settings_kwargs):
    """Run `check(case)` as a hypothesis property over `strategy` (plus the explicit
    cases first) under the loaded profile overridden by settings_kwargs. With budget_s,
    examples drawn after that many seconds are rejected (cheaply, before any tensor is
    made): the run is bounded in examples AND in time. Records what ran in RUN_STATS,
    with the plant (tests/plants.py) applied during the run, if any."""
    stats = {"examples": 0, "rejected_over_budget": 0, "seconds": 0.0, "max_errors": {},
             "plant": plants.active()}
    RUN_STATS[name] = stats
    start = time.monotonic()

    def body(case):
        if budget_s is not None and time.monotonic() - start > budget_s:
            stats["rejected_over_budget"] += 1
            reject()
        errors = check(case) or {}
        stats["examples"] += 1
        for out, err in errors.items():
            stats["max_errors"][out] = max(err, stats["max_errors"].get(out, 0.0))

    test = given(case=strategy)(body)
    for case in reversed(tuple(explicit)):
        test = example(case=case)(test)
    kwargs = dict(deadline=None, suppress_health_check=list(HealthCheck))
    kwargs.update(settings_kwargs)
    test = settings(settings.default, **kwargs)(test)
    try:
        test()
    except AssertionError:
        stats["failed"] = True
        raise
    except Unsatisfiable:
        # every generated example came after the budget: fine once some example ran
        if not (stats["examples"] and stats["rejected_over_budget"]):
            raise
    finally:
        stats["seconds"] = time.monotonic() - start


# Settings for re-running a property with a planted error: the explicit examples, then a
# few generated ones, no shrinking, nothing saved to the example database.
PLANT_SETTINGS = dict(phases=[Phase.explicit, Phase.generate], max_examples=2,
                      database=None, report_multiple_bugs=False, derandomize=True)
# On the GPU: the explicit examples only (their compiles and tunes are already cached).
PLANT_SETTINGS_EXPLICIT = dict(PLANT_SETTINGS, phases=[Phase.explicit])


def profile_examples(ci, thorough=None):
    """max_examples for a property: `ci` under the ci profile, else the loaded profile's
    count (or `thorough` when given and smaller)."""
    default = settings.default.max_examples
    if settings.get_current_profile_name() == "ci":
        return ci
    return default if thorough is None else min(default, thorough)
