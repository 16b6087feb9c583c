"""vitattn_bwd.integrations.swap_attention for timm and OpenCLIP vision transformers, on
the CPU.

timm and open_clip_torch cannot be imported on the CPU machines (their torchvision
dependency does not import beside the CPU build of torch), so these tests run against
STAND-INS defined below: small modules of our own, named TimmStyle* and OpenCLIPStyle*
(and LayerScaleStandIn, whose code the two libraries share), that reproduce the
attribute layout and the forward math of timm's vision_transformer.Block / Attention /
LayerScale / DropPath and of OpenCLIP's transformer.ResidualAttentionBlock (with
nn.MultiheadAttention, as in open_clip 3.3, or OpenCLIP's own Attention class, as in its
later sources) / LayerScale / CustomResidualAttentionBlock, as read from their sources.
They are not the libraries: the integrations are told about them with
`register_classes`, as a vendored copy would be. tests/test_gpu_integrations.py runs the
same swap against the real libraries.

Checked: matching, state_dict keys, checkpoints both ways, outputs and gradients of the
swapped model against the stock stand-in (float64 to 1e-12, float32 to 2e-5; the CPU path
is plain PyTorch), the LayerScale gradient, both batch_first settings, unswap, AdamW
steps, autocast, gradient checkpointing, pickling, and every refusal with its message.
"""
import copy
import io
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from vitattn_bwd import integrations
from vitattn_bwd.integrations import _common, swap_attention, swapped_layers, unswap_attention
from vitattn_bwd.integrations import open_clip as oc_integration
from vitattn_bwd.integrations import timm as timm_integration

from .helpers import (adamw_losses, graph_breaks_and_ops, recorded_calls,
                      recorded_half_dtypes)

DIM, HEADS, TOKENS, BATCH, EPS = 32, 4, 7, 2, 1e-5


class LayerScaleStandIn(nn.Module):
    """timm's LayerScale (timm/layers/layer_scale.py) and OpenCLIP's
    (src/open_clip/transformer.py), the same code in both: registered with both
    integrations below. NOT timm or open_clip."""

    def __init__(self, dim, init_values=1e-5, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


# --------------------------------------------------------------------------------------
# Stand-ins for timm (timm/models/vision_transformer.py, timm/layers/attention.py,
# layer_scale.py, drop.py): same attribute names, same forward math. NOT timm.
# --------------------------------------------------------------------------------------
class TimmStyleAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, scale_norm=False,
                 attn_drop=0., proj_drop=0., attn_head_dim=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = attn_head_dim or dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = nn.LayerNorm(self.attn_dim) if scale_norm else nn.Identity()
        self.gate = None
        self.proj = nn.Linear(self.attn_dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal,
            dropout_p=self.attn_drop.p if self.training else 0.)
        x = self.norm(x.transpose(1, 2).reshape(B, N, self.attn_dim))
        return self.proj_drop(self.proj(x))


class TimmStyleDropPath(nn.Module):
    def __init__(self, drop_prob=0.):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0. or not self.training:
            return x
        keep = 1 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class TimmStyleBlock(nn.Module):
    def __init__(self, dim=DIM, num_heads=HEADS, qkv_bias=False, qk_norm=False,
                 scale_norm=False, init_values=None, drop_path=0., attn_drop=0.,
                 proj_drop=0., eps=EPS, attn_head_dim=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = TimmStyleAttention(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                       scale_norm=scale_norm, attn_drop=attn_drop,
                                       proj_drop=proj_drop, attn_head_dim=attn_head_dim)
        self.ls1 = LayerScaleStandIn(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = TimmStyleDropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ls2 = LayerScaleStandIn(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = TimmStyleDropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x, attn_mask=None, is_causal=False):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask,
                                                   is_causal=is_causal)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class TimmStyleVisionTransformer(nn.Module):
    """Tokens in, tokens out: the blocks (an nn.Sequential, as timm's) and a final norm."""

    def __init__(self, depth=2, grad_checkpointing=False, **block_kwargs):
        super().__init__()
        self.blocks = nn.Sequential(*(TimmStyleBlock(**block_kwargs) for _ in range(depth)))
        self.norm = nn.LayerNorm(DIM)
        self.grad_checkpointing = grad_checkpointing

    def forward(self, x):
        if self.grad_checkpointing:
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False)
        else:
            x = self.blocks(x)
        return self.norm(x)


timm_integration.register_classes(block=TimmStyleBlock, attention=TimmStyleAttention,
                                  layer_scale=LayerScaleStandIn,
                                  drop_path=TimmStyleDropPath)


# --------------------------------------------------------------------------------------
# Stand-ins for OpenCLIP (src/open_clip/transformer.py): same attribute names and
# forward math. NOT open_clip.
# --------------------------------------------------------------------------------------
class OpenCLIPStyleAttention(nn.Module):
    """OpenCLIP's own Attention (its later sources; batch first, in_proj_weight /
    in_proj_bias / out_proj like nn.MultiheadAttention)."""

    def __init__(self, dim, num_heads=8, qkv_bias=True, qk_norm=False, scaled_cosine=False,
                 scale_heads=False, inner_norm=False, attn_drop=0., proj_drop=0.):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.in_proj_weight = nn.Parameter(torch.randn(3 * dim, dim) * dim ** -0.5)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim)) if qkv_bias else None
        self.ln_q = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.ln_k = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.logit_scale = (nn.Parameter(torch.log(10 * torch.ones(num_heads, 1, 1)))
                            if scaled_cosine else None)
        self.attn_drop = nn.Dropout(attn_drop)
        self.head_scale = nn.Parameter(torch.ones(num_heads, 1, 1)) if scale_heads else None
        self.ln_inner = nn.LayerNorm(dim) if inner_norm else nn.Identity()
        self.out_proj = nn.Linear(dim, dim)
        self.out_drop = nn.Dropout(proj_drop)

    def forward(self, x, k_x=None, v_x=None, attn_mask=None):
        N, L, C = x.shape
        k_x = x if k_x is None else k_x
        v_x = x if v_x is None else v_x
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = (self.in_proj_bias.chunk(3) if self.in_proj_bias is not None
                         else (None,) * 3)
        q, k, v = (F.linear(t, w, b).reshape(N, -1, self.num_heads, self.head_dim)
                   .transpose(1, 2) for t, w, b in ((x, w_q, b_q), (k_x, w_k, b_k),
                                                    (v_x, w_v, b_v)))
        if self.logit_scale is not None:
            attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
            attn = attn * torch.clamp(self.logit_scale, max=math.log(100.)).exp()
            if attn_mask is not None:
                attn = attn + attn_mask
            x = self.attn_drop(attn.softmax(dim=-1)) @ v
        else:
            x = F.scaled_dot_product_attention(
                self.ln_q(q), self.ln_k(k), v, attn_mask=attn_mask, scale=self.scale,
                dropout_p=self.attn_drop.p if self.training else 0.)
        if self.head_scale is not None:
            x = x * self.head_scale
        x = self.ln_inner(x.transpose(1, 2).reshape(N, -1, C))
        return self.out_drop(self.out_proj(x))


class OpenCLIPStyleResidualAttentionBlock(nn.Module):
    def __init__(self, d_model=DIM, n_head=HEADS, ls_init_value=None, batch_first=True,
                 attention="mha", eps=EPS, bias=True, **attn_kwargs):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=eps)
        if attention == "mha":
            self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=batch_first,
                                              bias=bias, **attn_kwargs)
        else:
            self.attn = OpenCLIPStyleAttention(d_model, n_head, qkv_bias=bias, **attn_kwargs)
        self.ls_1 = (LayerScaleStandIn(d_model, ls_init_value)
                     if ls_init_value is not None else nn.Identity())
        self.ln_2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(),
                                 nn.Linear(2 * d_model, d_model))
        self.ls_2 = (LayerScaleStandIn(d_model, ls_init_value)
                     if ls_init_value is not None else nn.Identity())

    def attention(self, q_x, k_x=None, v_x=None, attn_mask=None):
        k_x = k_x if k_x is not None else q_x
        v_x = v_x if v_x is not None else q_x
        attn_mask = attn_mask.to(q_x.dtype) if attn_mask is not None else None
        if isinstance(self.attn, nn.MultiheadAttention):
            return self.attn(q_x, k_x, v_x, need_weights=False, attn_mask=attn_mask)[0]
        return self.attn(q_x, k_x=k_x, v_x=v_x, attn_mask=attn_mask)

    def forward(self, q_x, k_x=None, v_x=None, attn_mask=None):
        x = q_x + self.ls_1(self.attention(q_x=self.ln_1(q_x), k_x=k_x, v_x=v_x,
                                           attn_mask=attn_mask))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class OpenCLIPStyleCustomResidualAttentionBlock(nn.Module):
    def __init__(self, d_model=DIM, n_head=HEADS, scale_cosine_attn=True, **attn_kwargs):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = OpenCLIPStyleAttention(d_model, n_head, scaled_cosine=scale_cosine_attn,
                                           **attn_kwargs)
        self.ln_attn = nn.Identity()
        self.ls_1 = nn.Identity()
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_model))
        self.ls_2 = nn.Identity()

    def forward(self, x, attn_mask=None):
        x = x + self.ls_1(self.ln_attn(self.attn(self.ln_1(x), attn_mask=attn_mask)))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class OpenCLIPStyleTransformer(nn.Module):
    """OpenCLIP's Transformer: [B,S,E] in and out, [S,B,E] to the blocks when not
    batch_first; checkpoint(block, x, None, None, attn_mask) with grad_checkpointing."""

    def __init__(self, layers=2, batch_first=True, block_cls=None, **block_kwargs):
        super().__init__()
        self.batch_first = batch_first
        self.grad_checkpointing = False
        block_cls = block_cls or OpenCLIPStyleResidualAttentionBlock
        if block_cls is OpenCLIPStyleResidualAttentionBlock:
            block_kwargs["batch_first"] = batch_first
        self.resblocks = nn.ModuleList(block_cls(**block_kwargs) for _ in range(layers))

    def forward(self, x, attn_mask=None):
        if not self.batch_first:
            x = x.transpose(0, 1).contiguous()
        for r in self.resblocks:
            if self.grad_checkpointing:
                x = checkpoint(r, x, None, None, attn_mask, use_reentrant=False)
            else:
                x = r(x, attn_mask=attn_mask)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return x


class OpenCLIPStyleVisionTransformer(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.transformer = OpenCLIPStyleTransformer(**kwargs)
        self.ln_post = nn.LayerNorm(DIM)

    def forward(self, x):
        return self.ln_post(self.transformer(x))


class OpenCLIPStyleCLIP(nn.Module):
    """A vision tower (`visual`) and a text transformer called with a causal mask."""

    def __init__(self):
        super().__init__()
        self.visual = OpenCLIPStyleVisionTransformer()
        self.transformer = OpenCLIPStyleTransformer()
        mask = torch.full((5, 5), float("-inf")).triu_(1)
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, image_tokens, text_tokens):
        return (self.visual(image_tokens),
                self.transformer(text_tokens, attn_mask=self.attn_mask))


oc_integration.register_classes(block=OpenCLIPStyleResidualAttentionBlock,
                                attention=OpenCLIPStyleAttention,
                                layer_scale=LayerScaleStandIn,
                                refused=OpenCLIPStyleCustomResidualAttentionBlock)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _perturb(model, seed=0, scale=0.2):
    """Every parameter off its init (LayerNorm weights off 1, biases and gammas off their
    constants), so that a wrong or missing parameter shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model


def _make(cls, dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    return _perturb(cls(**kwargs).to(dtype).eval(), seed=seed)


def _pair(cls, dtype=torch.float64, **kwargs):
    stock = _make(cls, dtype, **kwargs)
    return stock, swap_attention(copy.deepcopy(stock))


def _inputs(dtype=torch.float64, batch=BATCH, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, TOKENS, DIM, generator=g).to(dtype)
    w = torch.randn(batch, TOKENS, DIM, generator=g).to(dtype)
    return x, w


def _weighted_sum(model, x, w):
    """The tests' loss: the output weighted by w, summed."""
    return (model(x) * w).sum()


def _grads(model, x, w):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = model(x)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["input"] = x.grad.clone()
    return out.detach(), grads


def _key_bias(name):
    """The keys' bias gets no gradient in exact math (softmax ignores a constant added
    to all keys); measured against the whole bias's gradient norm."""
    return name.endswith(("qkv.bias", "in_proj_bias"))


def _errors(got, want):
    errors = {}
    for name, g in got.items():
        ref = want[name].double()
        diff = g.double() - ref
        if _key_bias(name):
            E = ref.numel() // 3
            diff = diff[E:2 * E]                 # the key part: its own gradient is ~0
        errors[name] = (diff.norm() / ref.norm()).item()
        if _key_bias(name):                      # the query and value parts alone
            other = torch.cat([g.double()[:E] - ref[:E], g.double()[2 * E:] - ref[2 * E:]])
            errors[name + " (q, v)"] = (other.norm() / ref.norm()).item()
    return errors


def _assert_same(stock, ours, dtype, bound, x_w=None):
    x, w = x_w or _inputs(dtype)
    want, grads_want = _grads(stock, x, w)
    got, grads_got = _grads(ours, x, w)
    err = ((got - want).norm() / want.norm()).item()
    assert err < bound, ("output", err)
    assert grads_got.keys() == grads_want.keys()
    for name, e in _errors(grads_got, grads_want).items():
        assert e < bound, (name, e)
    assert all(g.dtype == dtype for g in grads_got.values())
    return grads_got


@pytest.fixture
def spy(monkeypatch):
    """x's shape at each call of the fused attention half (proves the swap is in use)."""
    return recorded_calls(monkeypatch, _common, "vision_attention", lambda x, *args: x.shape)


BOUNDS = [(torch.float64, 1e-12), (torch.float32, 2e-5)]


# --------------------------------------------------------------------------------------
# timm
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,bound", BOUNDS)
@pytest.mark.parametrize("variant", [dict(), dict(init_values=0.3, qkv_bias=True)],
                         ids=["plain", "layerscale+qkv_bias"])
def test_timm_outputs_and_gradients_equal_the_stock_model(dtype, bound, variant, spy):
    stock, ours = _pair(TimmStyleVisionTransformer, dtype, **variant)
    assert swapped_layers(ours) == ["blocks.0", "blocks.1"]
    grads = _assert_same(stock, ours, dtype, bound)
    assert len(spy) == 2                                 # both blocks ran fused
    if "init_values" in variant:
        assert grads["blocks.0.ls1.gamma"].norm() > 0    # LayerScale gets its gradient
    else:
        assert stock.blocks[0].attn.qkv.bias is None     # timm's default: no qkv bias


def test_timm_layer_scale_gradient_against_float64_autograd():
    """The folded LayerScale's gamma gradient equals autograd through the stock block."""
    stock = _make(TimmStyleBlock, init_values=0.5)
    ours = swap_attention(copy.deepcopy(stock), vision_only=False)
    x, w = _inputs()
    _, want = _grads(stock, x, w)
    _, got = _grads(ours, x, w)
    for name in ("ls1.gamma", "attn.proj.weight", "attn.proj.bias"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-13)


def test_bfloat16_timm_block_with_layer_scale_is_native():
    """A bf16 timm model with LayerScale, swapped with the default precision: the stock
    block's computation in bf16 (the same ops: gamma multiplies the projection's output,
    as the stock LayerScale does), output and gradients bit for bit, every gradient
    bf16. (Folding gamma into a float32 out projection made the dtypes mixed, so such
    layers ran the float32 fused path while layers without LayerScale ran natively.)"""
    stock = _make(TimmStyleBlock, torch.bfloat16, init_values=0.5)
    ours = swap_attention(copy.deepcopy(stock), vision_only=False)
    x, w = _inputs(torch.bfloat16)
    out, got = _grads(ours, x, w)
    want_out, want = _grads(stock, x, w)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want_out)
    for name, g in got.items():
        assert g.dtype == torch.bfloat16 and torch.equal(g, want[name]), name


def test_bfloat16_open_clip_block_with_layer_scale_is_native():
    """The same for OpenCLIP, whose stock attention is nn.MultiheadAttention (other ops,
    so not the same bits): the swapped attention half is the stock ops' computation in
    bf16 with gamma on the projection's output (module.stock_forward), within bf16
    rounding of the stock block, every gradient bf16."""
    from vitattn_bwd.module import stock_forward
    stock = _make(OpenCLIPStyleResidualAttentionBlock, torch.bfloat16, ls_init_value=0.5)
    ours = swap_attention(copy.deepcopy(stock), vision_only=False)
    with torch.no_grad():                            # the MLP half off: the attention's
        for module in (stock, ours):
            for name, p in module.named_parameters():
                if name.startswith("mlp"):
                    p.zero_()
    x, w = _inputs(torch.bfloat16)
    out, got = _grads(ours, x, w)
    want_out, _ = _grads(stock, x, w)
    attn = stock.attn
    with torch.no_grad():
        native = stock_forward(x, stock.ln_1.weight, stock.ln_1.bias, attn.in_proj_weight,
                               attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias,
                               HEADS, stock.ln_1.eps, stock.ls_1.gamma)
    assert out.dtype == torch.bfloat16 and torch.equal(out, native)
    assert ((out.float() - want_out.float()).norm() / want_out.float().norm()) < 2e-2
    assert all(g.dtype == torch.bfloat16 for g in got.values())


def _assert_native_bfloat16(stock, ours, monkeypatch):
    """ours, the swapped bf16 model at precision "medium", runs every attention half on
    the fused one-product path in bf16 (LayerScale folded into the out projection in
    bf16): its output and gradients in bf16, each as close to the float64 model's as the
    stock bf16 model's, within half of bf16's unit roundoff more (the fold rounds
    gamma * W once)."""
    half_dtypes = recorded_half_dtypes(monkeypatch)
    x, w = _inputs(torch.bfloat16)
    out, got = _grads(ours, x, w)
    assert half_dtypes == [torch.bfloat16]
    want_out, want = _grads(stock, x, w)
    truth_out, truth = _grads(copy.deepcopy(stock).double(), x.double(), w.double())
    assert out.dtype == torch.bfloat16
    errors = _errors({"output": out, **got}, {"output": truth_out, **truth})
    stock_errors = _errors({"output": want_out, **want}, {"output": truth_out, **truth})
    for name, error in errors.items():
        assert error <= 1.5 * stock_errors[name] + 2 ** -9, (name, error, stock_errors[name])
    assert all(g.dtype == torch.bfloat16 for g in got.values())


@pytest.mark.parametrize("kind", ["timm", "open_clip"])
def test_bfloat16_block_with_layer_scale_at_precision_medium_runs_fused(monkeypatch, kind):
    """Swapped with precision "medium", a bf16 timm or OpenCLIP block with LayerScale
    runs the fused one-product path in bf16, as accurate as the stock bf16 model (the
    fold keeps every tensor bf16, so the layer runs natively)."""
    if kind == "timm":
        stock = _make(TimmStyleBlock, torch.bfloat16, init_values=0.5)
    else:
        stock = _make(OpenCLIPStyleResidualAttentionBlock, torch.bfloat16, ls_init_value=0.5)
    ours = swap_attention(copy.deepcopy(stock), vision_only=False, precision="medium")
    _assert_native_bfloat16(stock, ours, monkeypatch)


def test_vision_attention_checks_gamma():
    from vitattn_bwd.module import vision_attention
    block = _make(TimmStyleBlock, torch.float32)
    attn = block.attn
    args = (torch.randn(2, 5, DIM), block.norm1.weight, block.norm1.bias, attn.qkv.weight,
            torch.zeros(3 * DIM), attn.proj.weight, attn.proj.bias, attn.num_heads, 1e-6)
    with pytest.raises(ValueError, match=r"gamma must have shape \(%d,\)" % DIM):
        vision_attention(*args, gamma=torch.ones(DIM + 1))
    with pytest.raises(TypeError, match="gamma must be a torch.Tensor"):
        vision_attention(*args, gamma=0.5)


def test_timm_inplace_layer_scale():
    stock = _make(TimmStyleVisionTransformer, init_values=0.3)
    for blk in stock.blocks:
        blk.ls1.inplace = blk.ls2.inplace = True
    ours = swap_attention(copy.deepcopy(stock))
    _assert_same(stock, ours, torch.float64, 1e-12)


def test_timm_state_dict_checkpoints_and_unswap(spy):
    stock, ours = _pair(TimmStyleVisionTransformer, init_values=0.3)
    assert list(ours.state_dict()) == list(stock.state_dict())
    blk = ours.blocks[0]
    assert isinstance(blk, TimmStyleBlock) and type(blk) is not TimmStyleBlock
    x, _ = _inputs()
    fresh = _perturb(_make(TimmStyleVisionTransformer, init_values=0.3), seed=5)
    fresh.load_state_dict(ours.state_dict())             # swapped -> stock, strictly
    torch.testing.assert_close(fresh(x), ours(x), rtol=1e-12, atol=1e-12)
    other = swap_attention(_perturb(_make(TimmStyleVisionTransformer, init_values=0.3),
                                    seed=6))
    other.load_state_dict(stock.state_dict())            # stock -> swapped
    torch.testing.assert_close(other(x), stock(x), rtol=1e-12, atol=1e-12)
    calls = len(spy)
    unswap_attention(ours)
    assert type(ours.blocks[0]) is TimmStyleBlock and not swapped_layers(ours)
    assert not any(a.startswith("_vitattn") for a in vars(ours.blocks[0]))
    torch.testing.assert_close(ours(x), stock(x), rtol=0, atol=0)
    assert len(spy) == calls                             # unswapped: stock forward
    swap_attention(ours)                                 # and swapped again
    assert swapped_layers(ours) == ["blocks.0", "blocks.1"]


def test_timm_adamw_steps_track_the_stock_model():
    stock, ours = _pair(TimmStyleVisionTransformer, init_values=0.3, qkv_bias=True)
    losses = {key: adamw_losses(model, _weighted_sum, lambda step: _inputs(seed=10 + step),
                                4, lr=1e-2)
              for key, model in (("stock", stock), ("ours", ours))}
    torch.testing.assert_close(torch.tensor(losses["ours"]), torch.tensor(losses["stock"]),
                               rtol=1e-10, atol=0)
    assert losses["ours"][-1] != losses["ours"][0]
    for (name, a), (_, b) in zip(ours.named_parameters(), stock.named_parameters()):
        if _key_bias(name):
            E = a.numel() // 3               # keys' bias: zero exact gradient, noise steps
            a, b = torch.cat([a[:E], a[2 * E:]]), torch.cat([b[:E], b[2 * E:]])
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_timm_gradient_checkpointing_and_pickle(spy):
    stock, ours = _pair(TimmStyleVisionTransformer, init_values=0.3)
    for m in (stock, ours):
        m.grad_checkpointing = True
        m.train()
    grads = _assert_same(stock, ours, torch.float64, 1e-12)
    assert len(spy) >= 2 and grads
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert swapped_layers(loaded) == swapped_layers(ours)
    x, _ = _inputs()
    torch.testing.assert_close(loaded(x), ours(x), rtol=0, atol=0)


def test_timm_eval_mode_ignores_dropout_and_drop_path(spy):
    """Dropout and DropPath are no-ops in eval: such blocks are swapped and compute the
    stock result; only training mode refuses them (test_timm_refusals_at_the_call)."""
    kwargs = dict(attn_drop=0.1, proj_drop=0.1, drop_path=0.2, init_values=0.3)
    stock, ours = _pair(TimmStyleVisionTransformer, **kwargs)
    _assert_same(stock, ours, torch.float64, 1e-12)
    assert len(spy) == 2


def test_timm_dropout_is_read_from_the_modules_that_apply_it(spy):
    """Stock timm reads each dropout's own training flag: a model in eval mode with its
    dropouts put back in training mode (MC dropout) draws masks, so the swapped block
    refuses it rather than silently computing without; a model in training mode with
    its dropouts in eval mode draws none, and the swapped block computes it."""
    for kwargs, module, message in ((dict(proj_drop=0.2), "attn.proj_drop",
                                     r"attn.proj_drop.p 0.2 > 0"),
                                    (dict(drop_path=0.3), "drop_path1",
                                     r"drop_path1.drop_prob 0.3 > 0"),
                                    (dict(attn_drop=0.1), "attn.attn_drop",
                                     r"attn.attn_drop.p 0.1 > 0")):
        stock, ours = _pair(TimmStyleVisionTransformer, **kwargs)
        ours.eval()
        for blk in ours.blocks:
            blk.get_submodule(module).train()
        with pytest.raises(ValueError, match=message):
            ours(_inputs()[0])
    stock, ours = _pair(TimmStyleVisionTransformer, proj_drop=0.2, drop_path=0.3)
    for model in (stock, ours):
        model.train()
        for module in model.modules():
            if isinstance(module, (nn.Dropout, TimmStyleDropPath)):
                module.eval()
    assert ours.blocks[0].training and not ours.blocks[0].drop_path1.training
    _assert_same(stock, ours, torch.float64, 1e-12)


class LayerNormWithItsOwnForward(nn.LayerNorm):
    """A LayerNorm subclass that computes something else. NOT a library's class."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_layer_norms_with_forwards_of_their_own_are_refused():
    """The fused block computes a plain LayerNorm from the norm's weight and bias: a
    subclass with a forward of its own is refused at the swap, naming its class."""
    model = _make(TimmStyleVisionTransformer)
    model.blocks[1].norm1.__class__ = LayerNormWithItsOwnForward
    with pytest.raises(ValueError, match=r"^blocks.1: norm1 is tests.test_integrations."
                                         r"LayerNormWithItsOwnForward, a LayerNorm whose "
                                         r"forward is its own"):
        swap_attention(model)
    assert not swapped_layers(model)
    model = _make(OpenCLIPStyleVisionTransformer)
    model.transformer.resblocks[0].ln_1.__class__ = LayerNormWithItsOwnForward
    with pytest.raises(ValueError, match=r"ln_1 is tests.test_integrations."
                                         r"LayerNormWithItsOwnForward"):
        swap_attention(model)


class OpenCLIPStyleBlockWithItsOwnAttention(OpenCLIPStyleResidualAttentionBlock):
    """Attention-editing code's pattern (MaskCLIP / SCLIP style): the block's forward
    kept, its attention call overridden. NOT OpenCLIP."""

    def attention(self, q_x, k_x=None, v_x=None, attn_mask=None):
        return 0.5 * super().attention(q_x, k_x, v_x, attn_mask)


def test_open_clip_blocks_with_their_attention_overridden_are_refused():
    """The swapped forward replaces the block's `attention` call too: a block class or
    instance that overrides it is not swapped (the class is not matched; the instance
    is refused, naming the method), rather than silently computing stock attention."""
    model = _make(OpenCLIPStyleVisionTransformer)
    resblocks = model.transformer.resblocks
    resblocks[0].__class__ = OpenCLIPStyleBlockWithItsOwnAttention
    swap_attention(model)
    assert not _common.is_swapped(resblocks[0]) and _common.is_swapped(resblocks[1])
    model = _make(OpenCLIPStyleVisionTransformer)
    block = model.transformer.resblocks[1]
    block.attention = lambda q_x, **kwargs: 0.5 * type(block).attention(block, q_x, **kwargs)
    with pytest.raises(ValueError, match=r"transformer.resblocks.1: its attention is "
                                         r"overridden on the instance"):
        swap_attention(model)
    assert not swapped_layers(model)


def test_text_towers_of_a_dual_encoder_stay_stock():
    """A vision-text dual encoder's root class names "Vision": its text tower's layers
    (below a module whose class names "Text" and not "Vision") are not in the vision
    tower, its vision tower's are."""
    root = type("VisionTextDualEncoderModel", (nn.Module,), {})()
    root.text_model = type("CLIPTextTransformer", (nn.Module,), {})()
    root.text_model.layer = nn.Linear(1, 1)
    root.vision_model = type("CLIPVisionTransformer", (nn.Module,), {})()
    root.vision_model.layer = nn.Linear(1, 1)
    assert not _common._in_vision_tower(root, "text_model.layer")
    assert _common._in_vision_tower(root, "vision_model.layer")
    assert _common._in_vision_tower(root, "")


def test_jit_trace_is_refused_by_name():
    """torch.jit.trace would freeze the block's Python decisions into a trace (and passes
    shapes as tensors): refused with a message that names it and the alternatives."""
    _, ours = _pair(TimmStyleVisionTransformer)
    with pytest.raises(RuntimeError, match="does not support torch.jit.trace; use "
                                           "torch.export or torch.compile"):
        torch.jit.trace(ours, (_inputs()[0],), check_trace=False)


@pytest.mark.parametrize("cls,layer_scale", [
    (TimmStyleVisionTransformer, dict(init_values=0.3)),
    (OpenCLIPStyleVisionTransformer, dict(ls_init_value=0.3)),
], ids=["timm", "open_clip"])
def test_autocast_bfloat16_training_step(cls, layer_scale):
    """Under autocast the swapped block runs through vision_attention, and so follows
    autocast as the stock block does (vitattn_bwd.module); the step completes, gradients
    come back in the parameters' dtype, and the result is within bf16 accuracy of
    float64."""
    stock64 = _make(cls, **layer_scale)
    ours = swap_attention(copy.deepcopy(stock64).float())
    x, w = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x)
        loss = (out.float() * w).sum()
    loss.backward()
    want = stock64(x.double())
    assert ((out.double() - want).norm() / want.norm()).item() < 2e-2
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


def test_timm_layer_norm_eps_and_no_affine_are_carried():
    """A large eps makes a wrong one visible; a LayerNorm without affine parameters and
    an out projection without bias use ones / zeros."""
    stock = _make(TimmStyleBlock, eps=0.1)
    ours = swap_attention(copy.deepcopy(stock), vision_only=False)
    _assert_same(stock, ours, torch.float64, 1e-12)
    stock = TimmStyleBlock().double().eval()
    stock.norm1 = nn.LayerNorm(DIM, elementwise_affine=False).double()
    stock.attn.proj = nn.Linear(DIM, DIM, bias=False).double()
    _perturb(stock)
    ours = swap_attention(copy.deepcopy(stock), vision_only=False)
    _assert_same(stock, ours, torch.float64, 1e-12)


class RmsNormStandIn(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LoraLinear(nn.Linear):
    """A loralib-style adapter: an nn.Linear whose forward adds a low-rank term."""

    def __init__(self, linear, rank=2):
        super().__init__(linear.in_features, linear.out_features,
                         bias=linear.bias is not None, dtype=linear.weight.dtype)
        self.load_state_dict(linear.state_dict())
        self.lora_a = nn.Parameter(torch.randn(rank, linear.in_features,
                                               dtype=linear.weight.dtype))
        self.lora_b = nn.Parameter(torch.randn(linear.out_features, rank,
                                               dtype=linear.weight.dtype))

    def forward(self, x):
        return super().forward(x) + x @ self.lora_a.t() @ self.lora_b.t()


class TimmStyleAttentionOverridden(TimmStyleAttention):
    def forward(self, x, attn_mask=None, is_causal=False):
        return super().forward(x) * 2


def _timm_block_with(**changes):
    blk = TimmStyleBlock(**{k: v for k, v in changes.items() if k != "set"})
    for path, value in changes.get("set", {}).items():
        owner, _, attr = path.rpartition(".")
        setattr(blk.get_submodule(owner) if owner else blk, attr, value)
    return nn.Sequential(blk)


@pytest.mark.parametrize("changes,message", [
    (dict(qk_norm=True), r"0: attn.q_norm is LayerNorm: qk-norm is not supported"),
    (dict(scale_norm=True), r"0: attn.norm is LayerNorm: a norm of the attention output"),
    (dict(set={"attn.gate": nn.Linear(DIM, DIM)}), r"0: attn.gate is set: gated attention"),
    (dict(attn_head_dim=4), r"0: attn.qkv maps 32 -> 48, not 32 -> 96 \(an attention "
                            r"width other than embed_dim, or grouped-query"),
    (dict(set={"attn.qkv": nn.Linear(DIM, 2 * DIM)}), r"0: attn.qkv maps 32 -> 64.*"
                                                      r"grouped-query"),
    (dict(set={"attn.scale": 0.5}), r"0: attention scale 0.5 is not 1/sqrt\(head_dim\)"),
    (dict(set={"attn.num_heads": 3}), r"0: the fused block cannot take this layer: "
                                      r"num_heads=3 must divide embed_dim=32"),
    (dict(set={"norm1": RmsNormStandIn(DIM)}), r"0: norm1 is RmsNormStandIn, not a LayerNorm"),
    (dict(set={"ls1": nn.Dropout(0.0)}), r"0: ls1 is Dropout, neither Identity nor timm's "
                                         r"LayerScale"),
    (dict(set={"drop_path1": nn.Dropout(0.0)}), r"0: drop_path1 is Dropout, neither"),
    (dict(set={"attn": TimmStyleAttentionOverridden(DIM, HEADS)}),
     r"0: attn is TimmStyleAttentionOverridden, not timm's Attention"),
])
def test_timm_refusals_at_the_swap(changes, message):
    model = _timm_block_with(**changes)
    with pytest.raises(ValueError, match=message):
        swap_attention(model, vision_only=False)
    assert not swapped_layers(model)


@pytest.mark.parametrize("cls", [TimmStyleVisionTransformer, OpenCLIPStyleVisionTransformer],
                         ids=["timm", "open_clip"])
def test_swapped_towers_compile_with_dynamic_shapes_in_one_graph(cls):
    """torch.compile(dynamic=True, fullgraph=True) in training mode (the per-call checks
    of dropout and the projections traced too): each batch size gives the stock
    tower's output."""
    stock, ours = _pair(cls, dtype=torch.float32)
    compiled = torch.compile(ours.train(), dynamic=True, fullgraph=True)
    for batch in (2, 3):
        x = _inputs(torch.float32, batch=batch)[0]
        torch.testing.assert_close(compiled(x), stock.train()(x), rtol=1e-5, atol=1e-5)


def test_projections_with_forwards_of_their_own_are_refused():
    """The fused block reads a projection's weight and bias and never calls its forward:
    a Linear subclass that adds to it (an adapter) is refused at the swap, and one put
    in place after the swap at the call, rather than silently left out. A subclass
    that keeps nn.Linear's forward (nn.MultiheadAttention's out_proj class) swaps."""
    model = _make(TimmStyleVisionTransformer)
    model.blocks[1].attn.proj = LoraLinear(model.blocks[1].attn.proj)
    with pytest.raises(ValueError, match=r"^blocks.1: attn.proj is tests.test_integrations.LoraLinear, "
                                         r"whose forward is not torch.nn.modules.linear.Linear's: the fused block reads"):
        swap_attention(model)
    assert not swapped_layers(model)
    stock, ours = _pair(TimmStyleVisionTransformer)
    ours.blocks[0].attn.qkv = LoraLinear(ours.blocks[0].attn.qkv)
    with pytest.raises(ValueError, match=r"^blocks.0 \(VitAttnTimmStyleBlock, vitattn_bwd "
                                         r"fused attention\): attn.qkv is tests.test_integrations.LoraLinear"):
        ours(_inputs()[0])
    model = _make(OpenCLIPStyleVisionTransformer)
    model.transformer.resblocks[0].attn.out_proj = LoraLinear(
        model.transformer.resblocks[0].attn.out_proj)
    with pytest.raises(ValueError, match=r"attn.out_proj is tests.test_integrations.LoraLinear, whose forward"):
        swap_attention(model)
    assert isinstance(_make(OpenCLIPStyleVisionTransformer).transformer.resblocks[0].attn
                      .out_proj, nn.modules.linear.NonDynamicallyQuantizableLinear)
    assert swapped_layers(swap_attention(_make(OpenCLIPStyleVisionTransformer)))


def test_timm_hooked_layers_are_refused_and_nothing_is_swapped_half_way():
    model = _make(TimmStyleVisionTransformer, depth=3)
    blk = model.blocks[2]
    blk.forward = blk.forward                       # accelerate's hooks do this
    with pytest.raises(ValueError, match="blocks.2: its forward is overridden on the "
                                         "instance.*device_map"):
        swap_attention(model)
    assert not swapped_layers(model)
    model = _make(TimmStyleVisionTransformer)
    model.blocks[1].attn.qkv.forward = model.blocks[1].attn.qkv.forward
    with pytest.raises(ValueError, match="blocks.1: attn.qkv.forward is overridden"):
        swap_attention(model)
    model = _make(TimmStyleVisionTransformer)
    model.blocks[0].attn.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match=r"blocks.0: attn has forward hooks \(.*\), which "
                                         "would no longer fire"):
        swap_attention(model)
    assert not swapped_layers(model)
    model = _make(TimmStyleVisionTransformer)
    model.blocks[0].attn.proj.register_full_backward_hook(lambda *args: None)
    with pytest.raises(ValueError, match=r"blocks.0: attn.proj has backward hooks \(.*\), "
                                         "which would no longer fire"):
        swap_attention(model)
    model = _make(TimmStyleVisionTransformer)       # any module under a bypassed one
    model.blocks[0].attn.attn_drop.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="blocks.0: attn.attn_drop has forward hooks"):
        swap_attention(model)
    model = _make(TimmStyleVisionTransformer)       # hooks on the block itself are fine
    seen = []
    model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    swap_attention(model)(_inputs()[0])
    assert seen == [(BATCH, TOKENS, DIM)]


def test_timm_refusals_at_the_call():
    _, ours = _pair(TimmStyleVisionTransformer, attn_drop=0.1)
    blk, x = ours.blocks[0], _inputs()[0]
    with pytest.raises(ValueError, match=r"blocks.0 \(VitAttnTimmStyleBlock, vitattn_bwd "
                                         r"fused attention\) does not support attn_mask"):
        blk(x, attn_mask=torch.zeros(TOKENS, TOKENS, dtype=x.dtype))
    with pytest.raises(ValueError, match="does not support is_causal=True"):
        blk(x, is_causal=True)
    ours.train()
    with pytest.raises(ValueError, match=r"blocks.0 \(VitAttnTimmStyleBlock, vitattn_bwd "
                                         r"fused attention\) with dropout in training mode: "
                                         r"attn.attn_drop.p 0.1 > 0 is not supported"):
        ours(x)
    _, ours = _pair(TimmStyleVisionTransformer, proj_drop=0.2)
    with pytest.raises(ValueError, match=r"attn.proj_drop.p 0.2 > 0"):
        ours.train()(x)
    _, ours = _pair(TimmStyleVisionTransformer, drop_path=0.3)
    with pytest.raises(ValueError, match=r"drop_path1.drop_prob 0.3 > 0"):
        ours.train()(x)


def test_timm_blocks_outside_a_vision_module_need_vision_only_false():
    blocks = nn.Sequential(_make(TimmStyleBlock), _make(TimmStyleBlock, seed=1))
    with pytest.raises(ValueError, match="found no layer to swap in Sequential.*timm "
                                         "Blocks.*vision_only=False"):
        swap_attention(blocks)
    assert swapped_layers(swap_attention(blocks, vision_only=False)) == ["0", "1"]


def test_timm_subclass_with_its_own_forward_is_not_matched():
    class OtherBlock(TimmStyleBlock):
        def forward(self, x):
            return x + self.attn(self.norm1(x))

    class KeepsForward(TimmStyleBlock):
        pass
    model = nn.Sequential(_make(OtherBlock), _make(KeepsForward))
    swap_attention(model, vision_only=False)
    assert swapped_layers(model) == ["1"]


# --------------------------------------------------------------------------------------
# OpenCLIP
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,bound", BOUNDS)
@pytest.mark.parametrize("variant", [
    dict(batch_first=True), dict(batch_first=False),
    dict(batch_first=False, ls_init_value=0.3, bias=False),
    dict(attention="open_clip", ls_init_value=0.3)],
    ids=["mha-batch_first", "mha-seq_first", "mha-seq_first-layerscale-nobias",
         "open_clip_attention-layerscale"])
def test_open_clip_outputs_and_gradients_equal_the_stock_model(dtype, bound, variant, spy):
    stock, ours = _pair(OpenCLIPStyleVisionTransformer, dtype, **variant)
    assert swapped_layers(ours) == ["transformer.resblocks.0", "transformer.resblocks.1"]
    grads = _assert_same(stock, ours, dtype, bound)
    assert len(spy) == 2 and all(s == (BATCH, TOKENS, DIM) for s in spy)
    if "ls_init_value" in variant:
        assert grads["transformer.resblocks.0.ls_1.gamma"].norm() > 0


def test_open_clip_seq_first_block_takes_and_returns_seq_first():
    stock = _make(OpenCLIPStyleResidualAttentionBlock, batch_first=False)
    ours = swap_attention(copy.deepcopy(stock), vision_only=False)
    x = torch.randn(TOKENS, BATCH, DIM, dtype=torch.float64)      # [S, B, E]
    want, got = stock(x), ours(x)
    assert got.shape == (TOKENS, BATCH, DIM) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_open_clip_state_dict_checkpoints_and_unswap():
    stock, ours = _pair(OpenCLIPStyleVisionTransformer, ls_init_value=0.3)
    assert list(ours.state_dict()) == list(stock.state_dict())
    assert all(isinstance(b, OpenCLIPStyleResidualAttentionBlock)
               for b in ours.transformer.resblocks)
    x, _ = _inputs()
    fresh = _perturb(_make(OpenCLIPStyleVisionTransformer, ls_init_value=0.3), seed=5)
    fresh.load_state_dict(ours.state_dict())
    torch.testing.assert_close(fresh(x), ours(x), rtol=1e-12, atol=1e-12)
    unswap_attention(ours)
    assert not swapped_layers(ours)
    assert type(ours.transformer.resblocks[0]) is OpenCLIPStyleResidualAttentionBlock
    torch.testing.assert_close(ours(x), stock(x), rtol=0, atol=0)


def test_open_clip_grad_checkpointing(spy):
    """OpenCLIP's Transformer calls checkpoint(block, x, None, None, attn_mask)."""
    stock, ours = _pair(OpenCLIPStyleVisionTransformer, batch_first=False)
    for m in (stock, ours):
        m.transformer.grad_checkpointing = True
        m.train()
    _assert_same(stock, ours, torch.float64, 1e-12)
    assert len(spy) >= 2


def test_open_clip_clip_model_swaps_only_its_vision_tower(spy):
    stock, ours = _pair(OpenCLIPStyleCLIP)
    assert swapped_layers(ours) == ["visual.transformer.resblocks.0",
                                    "visual.transformer.resblocks.1"]
    image, _ = _inputs()
    text = torch.randn(BATCH, 5, DIM, dtype=torch.float64)
    (img_want, txt_want), (img_got, txt_got) = stock(image, text), ours(image, text)
    assert len(spy) == 2
    torch.testing.assert_close(img_got, img_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(txt_got, txt_want, rtol=0, atol=0)
    # with vision_only=False the text blocks are swapped too, and refuse the causal mask
    everything = swap_attention(copy.deepcopy(stock), vision_only=False)
    assert len(swapped_layers(everything)) == 4
    with pytest.raises(ValueError, match=r"^transformer.resblocks.0 .*does not support "
                                         "attn_mask"):
        everything(image, text)


def test_open_clip_adamw_steps_track_the_stock_model():
    stock, ours = _pair(OpenCLIPStyleVisionTransformer, ls_init_value=0.3,
                        batch_first=False)
    for model in (stock, ours):
        adamw_losses(model, _weighted_sum, lambda step: _inputs(seed=10 + step), 4, lr=1e-2)
    for (name, a), (_, b) in zip(ours.named_parameters(), stock.named_parameters()):
        if _key_bias(name):
            E = a.numel() // 3
            a, b = torch.cat([a[:E], a[2 * E:]]), torch.cat([b[:E], b[2 * E:]])
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("kwargs,message", [
    (dict(attention="mha", add_bias_kv=True), r"0: attn has bias_k/bias_v"),
    (dict(attention="mha", add_zero_attn=True), r"0: attn has add_zero_attn=True"),
    (dict(attention="mha", kdim=16, vdim=16), r"0: attn has separate q/k/v projection"),
    (dict(attention="open_clip", scaled_cosine=True), r"0: attn uses scaled-cosine "
                                                      r"attention \(logit_scale\)"),
    (dict(attention="open_clip", qk_norm=True), r"0: attn.ln_q is LayerNorm: qk-norm"),
    (dict(attention="open_clip", scale_heads=True), r"0: attn has head_scale"),
    (dict(attention="open_clip", inner_norm=True), r"0: attn.ln_inner is LayerNorm"),
])
def test_open_clip_refusals_at_the_swap(kwargs, message):
    model = nn.Sequential(OpenCLIPStyleResidualAttentionBlock(**kwargs))
    with pytest.raises(ValueError, match=message):
        swap_attention(model, vision_only=False)
    assert not swapped_layers(model)


def test_open_clip_custom_block_is_refused():
    model = OpenCLIPStyleVisionTransformer(block_cls=OpenCLIPStyleCustomResidualAttentionBlock)
    with pytest.raises(ValueError, match=r"transformer.resblocks.0: "
                                         r"OpenCLIPStyleCustomResidualAttentionBlock is not "
                                         r"supported \(it has scaled-cosine attention\)"):
        swap_attention(model)
    assert not swapped_layers(model)


def test_open_clip_other_refusals_at_the_swap():
    model = OpenCLIPStyleVisionTransformer()
    model.transformer.resblocks[1].ls_1 = nn.Dropout(0.0)
    with pytest.raises(ValueError, match="resblocks.1: ls_1 is Dropout, neither Identity "
                                         "nor OpenCLIP's LayerScale"):
        swap_attention(model)
    model = OpenCLIPStyleVisionTransformer()
    model.transformer.resblocks[0].attn.out_proj.register_forward_pre_hook(
        lambda *args: None)
    with pytest.raises(ValueError, match="resblocks.0: attn.out_proj has forward-pre hooks"):
        swap_attention(model)
    model = OpenCLIPStyleVisionTransformer()
    model.transformer.resblocks[0].attn.num_heads = 5
    with pytest.raises(ValueError, match="resblocks.0: the fused block cannot take this "
                                         "layer: num_heads=5 must divide embed_dim=32"):
        swap_attention(model)
    assert not swapped_layers(model)


def test_open_clip_refusals_at_the_call():
    _, ours = _pair(OpenCLIPStyleVisionTransformer, dropout=0.1)
    blk, x = ours.transformer.resblocks[0], _inputs()[0]
    with pytest.raises(ValueError, match=r"does not support cross-attention \(k_x / v_x\)"):
        blk(x, x, x)
    with pytest.raises(ValueError, match="does not support attn_mask"):
        blk(x, attn_mask=torch.zeros(TOKENS, TOKENS, dtype=x.dtype))
    _assert_same(*_pair(OpenCLIPStyleVisionTransformer, dropout=0.1), torch.float64, 1e-12)
    with pytest.raises(ValueError, match=r"in training mode: attn.dropout 0.1 > 0"):
        ours.train()(x)
    _, ours = _pair(OpenCLIPStyleVisionTransformer, attention="open_clip", proj_drop=0.2)
    with pytest.raises(ValueError, match=r"attn.out_drop.p 0.2 > 0"):
        ours.train()(x)


# --------------------------------------------------------------------------------------
# the entry point
# --------------------------------------------------------------------------------------
class MixedVisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.timm_blocks = nn.Sequential(TimmStyleBlock(), TimmStyleBlock(init_values=0.3))
        self.open_clip_blocks = nn.ModuleList([
            OpenCLIPStyleResidualAttentionBlock(attention="open_clip", ls_init_value=0.3)])

    def forward(self, x):
        x = self.timm_blocks(x)
        for blk in self.open_clip_blocks:
            x = blk(x)
        return x


def test_one_entry_point_dispatches_by_library(spy):
    stock, ours = _pair(MixedVisionTower)
    assert swapped_layers(ours) == ["timm_blocks.0", "timm_blocks.1", "open_clip_blocks.0"]
    assert type(ours.timm_blocks[0]).__module__ == "vitattn_bwd.integrations.timm"
    assert type(ours.open_clip_blocks[0]).__module__ == "vitattn_bwd.integrations.open_clip"
    _assert_same(stock, ours, torch.float64, 1e-12)
    assert len(spy) == 3
    # library filter, and each library module's own swap_attention
    only_timm = swap_attention(copy.deepcopy(stock), libraries=["timm"])
    assert swapped_layers(only_timm) == ["timm_blocks.0", "timm_blocks.1"]
    one_name = swap_attention(copy.deepcopy(stock), libraries="timm")   # a name alone
    assert swapped_layers(one_name) == ["timm_blocks.0", "timm_blocks.1"]
    only_oc = oc_integration.swap_attention(copy.deepcopy(stock))
    assert swapped_layers(only_oc) == ["open_clip_blocks.0"]
    assert timm_integration.swapped_layers(timm_integration.swap_attention(
        copy.deepcopy(stock))) == ["timm_blocks.0", "timm_blocks.1"]
    with pytest.raises(ValueError, match=r"unknown libraries \['keras'\]"):
        swap_attention(stock, libraries="keras")
    with pytest.raises(ValueError, match="found no layer to swap in Linear.*Hugging Face"
                                         ".*timm Blocks.*OpenCLIP"):
        swap_attention(nn.Linear(4, 4), vision_only=False)
    # swapping twice is a no-op; the hf module's unswap restores these layers too
    assert swapped_layers(swap_attention(ours)) == swapped_layers(ours)
    integrations.hf.unswap_attention(ours)
    assert not swapped_layers(ours)
    assert type(ours.timm_blocks[0]) is TimmStyleBlock


def test_importing_the_integrations_imports_no_library():
    import subprocess
    import sys
    code = ("import sys, vitattn_bwd.integrations as i; "
            "print(sorted(m for m in ('timm', 'open_clip', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("cls", [TimmStyleBlock, OpenCLIPStyleResidualAttentionBlock])
def test_swap_precision_under_autocast(cls):
    """precision=None (default): a swapped block follows autocast (bf16 math, the stock
    block's error against float64); precision="high": the fused float32-grade path
    inside autocast too. The MLP half is zeroed, so the output is the attention half's."""
    stock64 = _make(cls)
    with torch.no_grad():
        for name, p in stock64.named_parameters():
            if name.startswith("mlp"):
                p.zero_()
    x, _ = _inputs(torch.float32)
    want = stock64(x.double())

    def error(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return ((out.double() - want).norm() / want.norm()).item()
    stock_error = error(copy.deepcopy(stock64).float())
    errors = {precision: error(swap_attention(copy.deepcopy(stock64).float(),
                                              vision_only=False, precision=precision))
              for precision in (None, "high")}
    assert errors["high"] < 1e-5 and errors["high"] * 50 < stock_error, (errors, stock_error)
    assert 10 * errors["high"] < errors[None] < 3 * stock_error, (errors, stock_error)


def test_swap_refuses_an_unknown_precision_and_swaps_nothing():
    model = _make(TimmStyleVisionTransformer)
    with pytest.raises(ValueError, match="precision must be one of"):
        swap_attention(model, precision="low")
    assert not swapped_layers(model)


# --------------------------------------------------------------------------------------
# inside torch.compile
# --------------------------------------------------------------------------------------
def _compiled_grads(model, x, w):
    """_grads through torch.compile(model, fullgraph=True), read from model's own
    parameters."""
    compiled = torch.compile(model, fullgraph=True)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = compiled(x)
    (out.float() * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["input"] = x.grad.clone()
    return out.detach(), grads


COMPILED_TOWERS = [(TimmStyleVisionTransformer, dict(init_values=0.3)),
                   (OpenCLIPStyleVisionTransformer, dict(ls_init_value=0.3)),
                   (OpenCLIPStyleVisionTransformer, dict(attention="open_clip",
                                                         batch_first=False))]


@pytest.mark.parametrize("cls,kwargs", COMPILED_TOWERS)
def test_swapped_float32_tower_compiles_in_one_graph(cls, kwargs):
    """float32: no graph break (torch._dynamo.explain), the fused block's forward as
    our operator in the user's graph, and torch.compile(fullgraph=True)'s forward and
    backward as close to the float64 stock tower as the eager swap is, and equal to it
    within float32 rounding."""
    stock64 = _make(cls, **kwargs)
    ours = swap_attention(copy.deepcopy(stock64).float())
    x, w = _inputs(torch.float32)
    assert graph_breaks_and_ops(ours, x) == (0, {"vitattn_bwd.vision_attention_fwd"})
    got, got_grads = _compiled_grads(ours, x, w)
    eager, eager_grads = _grads(ours, x, w)
    want, want_grads = _grads(stock64, x.double(), w.double())
    assert ((got - eager).norm() / eager.norm()).item() < 1e-6
    assert ((got.double() - want).norm() / want.norm()).item() < 2e-5
    for name, err in _errors(got_grads, eager_grads).items():
        assert err < 1e-5, (name, err)
    for name, err in _errors(got_grads, want_grads).items():
        assert err < 2e-5, (name, err)
    assert all(g.dtype == torch.float32 for g in got_grads.values())


@pytest.mark.parametrize("cls,kwargs", COMPILED_TOWERS[:2])
def test_swapped_tower_under_autocast_compiles_the_stock_ops_in_one_graph(cls, kwargs):
    """Under bf16 autocast (precision None) the swapped attention halves are the stock
    ops (vitattn_bwd.routing): no graph break, none of our operators, and the compiled
    step within bf16 rounding of the eager one and of the float64 tower."""
    stock64 = _make(cls, **kwargs)
    ours = swap_attention(copy.deepcopy(stock64).float())
    x, w = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert graph_breaks_and_ops(ours, x) == (0, set())
        got, got_grads = _compiled_grads(ours, x, w)
        eager, eager_grads = _grads(ours, x, w)
    want = stock64(x.double())
    assert ((got.double() - want).norm() / want.norm()).item() < 2e-2
    # (measured: 1e-7 for the outputs, up to 2.2e-3 for a gradient, OpenCLIP's)
    assert ((got.double() - eager.double()).norm() / eager.double().norm()).item() < 1e-3
    for name, err in _errors(got_grads, eager_grads).items():
        assert err < 2e-2, (name, err)
    assert all(g.dtype == torch.float32 for g in got_grads.values())


# --------------------------------------------------------------------------------------
# Stand-in for a transformers 4.x CLIP encoder layer (modeling_clip.py of 4.4x: explicit
# attention_mask, causal_attention_mask and output_attentions arguments, a tuple out),
# for the hf integration without transformers. NOT transformers.
# --------------------------------------------------------------------------------------
class LegacyStyleCLIPAttention(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = dim, heads, dim // heads
        self.scale, self.dropout = self.head_dim ** -0.5, 0.0
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim)
                                                                for _ in range(4))

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None,
                output_attentions=False):
        B, S, E = hidden_states.shape
        q, k, v = (lin(hidden_states).view(B, S, self.num_heads, -1).transpose(1, 2)
                   for lin in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, E)
        return self.out_proj(out), None


class LegacyStyleCLIPEncoderLayer(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS):
        super().__init__()
        self.self_attn = LegacyStyleCLIPAttention(dim, heads)
        self.layer_norm1 = nn.LayerNorm(dim, eps=EPS)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.layer_norm2 = nn.LayerNorm(dim, eps=EPS)

    def forward(self, hidden_states, attention_mask, causal_attention_mask,
                output_attentions=False):
        residual = hidden_states
        hidden_states, attn_weights = self.self_attn(
            hidden_states=self.layer_norm1(hidden_states), attention_mask=attention_mask,
            causal_attention_mask=causal_attention_mask, output_attentions=output_attentions)
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.layer_norm2(hidden_states))
        outputs = (hidden_states,)
        if output_attentions:
            outputs += (attn_weights,)
        return outputs


# CLIP's math in code of its own (not transformers' CLIPEncoderLayer.forward): declared
integrations.hf.register_classes(layer=LegacyStyleCLIPEncoderLayer)


class LegacyStyleCLIPVisionTower(nn.Module):
    """As 4.x's CLIPEncoder calls its layers: (hidden, mask, causal mask,
    output_attentions=...)."""

    def __init__(self, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(LegacyStyleCLIPEncoderLayer() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, None, None, output_attentions=False)[0]
        return x


def _separate_projection_errors(got, want):
    """_errors, the keys' own bias (k_proj.bias, ~0 in exact math) measured against its
    layer's query bias gradient."""
    errors = _errors(got, want)
    for name in [n for n in errors if n.endswith("k_proj.bias")]:
        query = want[name.replace("k_proj", "q_proj")].double()
        errors[name] = ((got[name].double() - want[name].double()).norm()
                        / query.norm()).item()
    return errors


def test_transformers_4_style_layers_swap_and_bind_their_arguments_by_name():
    stock, ours = _pair(LegacyStyleCLIPVisionTower)
    assert swapped_layers(ours) == ["layers.0", "layers.1"]
    x, w = _inputs(torch.float64)
    (want, want_grads), (got, got_grads) = _grads(stock, x, w), _grads(ours, x, w)
    assert ((got - want).norm() / want.norm()).item() < 1e-12
    for name, err in _separate_projection_errors(got_grads, want_grads).items():
        assert err < 1e-12, (name, err)
    layer = ours.layers[0]
    x = torch.randn(1, TOKENS, DIM, dtype=torch.float64)
    assert torch.equal(layer(x, None, None)[0], layer(x, None, None, False)[0])
    mask = torch.zeros(1, 1, TOKENS, TOKENS, dtype=torch.float64)
    with pytest.raises(ValueError, match="does not support attention_mask"):
        layer(x, mask, None)
    with pytest.raises(ValueError, match="does not support causal_attention_mask"):
        layer(x, None, causal_attention_mask=mask)
    for call in (lambda: layer(x, None, None, True),
                 lambda: layer(x, None, None, output_attentions=True)):
        with pytest.raises(ValueError, match="output_attentions=True is not supported"):
            call()
    with pytest.raises(TypeError, match="takes 4 positional arguments, got 5"):
        layer(x, None, None, False, None)


def test_transformers_4_style_tower_compiles_in_one_graph():
    stock64 = _make(LegacyStyleCLIPVisionTower)
    ours = swap_attention(copy.deepcopy(stock64).float())
    x, w = _inputs(torch.float32)
    assert graph_breaks_and_ops(ours, x) == (0, {"vitattn_bwd.vision_attention_fwd"})
    got, got_grads = _compiled_grads(ours, x, w)
    want, want_grads = _grads(stock64, x.double(), w.double())
    assert ((got.double() - want).norm() / want.norm()).item() < 2e-5
    for name, err in _separate_projection_errors(got_grads, want_grads).items():
        assert err < 2e-5, (name, err)
