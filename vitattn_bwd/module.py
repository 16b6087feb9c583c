"""VisionAttentionBlock: the attention half of a Molmo/CLIP vision-tower layer,
    y = x + out_proj(attention(qkv(LayerNorm(x)))),
whose backward is vitattn_bwd's fused backward (ln_grad="exact").

The forward (forward_graph.py) is PyTorch math around one fused attention operator
(attention_fwd.py) that returns the attention output and the softmax's row log-sum-exp;
on CUDA it is compiled. It saves x, its LayerNorm statistics, the QKV projection (q, k
and v are its views), the log-sum-exp and the attention output (about 11.8 MB per image
at 577 tokens, 1024 wide, 16 heads; P alone would be 21.3 MB); the backward recomputes
x_norm and every P tile.

`vision_attention` is the functional entry point that VisionAttentionBlock and the
integrations call: it gathers the call's facts, follows routing.route's decision (the
stock ops, or the fused path at a precision and in dtypes), casts, then runs
VisionAttentionFunction, or, while torch.compile traces the call, the same forward and
backward as block_ops.py's torch.library operators. What each `precision=` (None,
"highest", "high", "medium") runs and in which dtypes: docs/precision.md. y has x's
dtype; every gradient comes back in its own tensor's dtype. Everything the backward
needs checked is checked in the forward. Also here: the weight converters from Molmo's
and CLIP's layouts (convert_state_dict).
"""
import torch
from torch import nn
from torch.nn import functional as F

from . import block_ops, deterministic_sdpa, graph, routing
from .block_ops import autocast_off
from .forward_graph import SavedForBackward, attention_block_forward
from .layout import merge_heads, qkv_heads
from .precision import Products
# where the one-product path runs, and torch's float32 matmul precision (routing.py)
from .routing import one_product_supported, torch_float32_precision  # noqa: F401
from .validation import (check_block_inputs, check_config, check_fused_dtypes,
                         check_fused_inputs, check_precision, check_x)

DOUBLE_BACKWARD_MESSAGE = (
    "VisionAttentionBlock does not support double backward (create_graph=True): its "
    "backward is a fused kernel without a graph of its own. Where second derivatives "
    "are needed, run the stock ops with an attention backend that has them: "
    "torch.func transforms (torch.func.grad of torch.func.grad) run the block's stock "
    "ops, inside torch.nn.attention.sdpa_kernel(SDPBackend.MATH); or unswap_attention "
    "a swapped tower.")


def stock_forward(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias,
                  num_heads, eps, gamma=None, deterministic_attention=False):
    """y = x + out_proj(SDPA(qkv(LayerNorm(x)))) (times gamma, a LayerScale, before the
    residual) in the stock ops, in the caller's autocast region or in the tensors' own
    dtype: what torch's own LayerNorm, Linear and SDPA compute there, and their
    autograd; with deterministic_attention, SDPA as deterministic_sdpa's attention (the
    same forward, our deterministic backward)."""
    E = x.shape[-1]
    h = F.layer_norm(x, (E,), ln_weight, ln_bias, eps)
    qkv = F.linear(h, qkv_weight, qkv_bias)                                    # [B,S,3E]
    if deterministic_attention:
        attn = deterministic_sdpa.attention(qkv, num_heads)                    # [B,S,E]
    else:
        q, k, v = qkv_heads(qkv, num_heads)                                    # [B,H,S,D]
        attn = merge_heads(F.scaled_dot_product_attention(q, k, v))            # [B,S,E]
    out = F.linear(attn, out_weight, out_bias)
    return x + (out if gamma is None else out * gamma)


class VisionAttentionFunction(torch.autograd.Function):
    """The autograd Function: forward math + the fused backward. All seven tensors must
    share one device and one dtype, float32 (or float64 on the CPU); use
    `vision_attention` for any other dtype or under autocast. products: a
    precision.Products (routing.route's; BF16X3, precision "high", by default), carried
    unchanged to the backward: ONE_BF16 / ONE_FP16
    is the one-product path (float32 tensors, or tensors all of that dtype: a bf16 /
    fp16 block; the projections and the attention one product each in that dtype, as
    under autocast). Errors are raised here, in the forward, never
    later in the backward. Not twice differentiable. block_checked: the caller
    (`vision_attention`) has run check_block_inputs on these tensors already, so only the
    fused path's own checks run here."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias,
                num_heads, eps, products=Products.BF16X3, block_checked=False):
        params = (ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias)
        if block_checked:
            check_fused_dtypes(x, params, products)
        else:
            num_heads, eps = check_fused_inputs(x, params, num_heads, eps, products)
        # The math runs as written, whatever autocast region the caller is in: an
        # autocast linear would hand bf16 q, k, v to the float32 backward.
        with autocast_off(x.device.type):
            y, saved, scale = attention_block_forward(x, *params, num_heads, eps, products)
        ctx.save_for_backward(*saved)
        ctx.num_heads, ctx.eps, ctx.scale, ctx.products = num_heads, eps, scale, products
        return y

    @staticmethod
    def backward(ctx, grad_y):
        # Autograd runs a backward with grad mode on only for create_graph=True.
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)
        saved = SavedForBackward(*ctx.saved_tensors)
        x = saved.x
        if x.numel() == 0:             # empty batch or no tokens: nothing to sum
            E = x.shape[-1]
            zeros = [x.new_zeros(shape) for shape in
                     ((E,), (E,), (3 * E, E), (3 * E,), (E, E), (E,))]
            return (torch.zeros_like(x), *zeros, None, None, None, None)
        # A backward called inside an autocast region (on the CPU it runs on the caller's
        # thread) must not turn our float32 math into bf16 either.
        with autocast_off(x.device.type):
            (grad_x, grad_qkv_weight, grad_qkv_bias, grad_out_weight, grad_out_bias,
             grad_ln_weight, grad_ln_bias) = graph.compiled_backward(
                dict(grad_output=grad_y.contiguous(), **saved._asdict()), scale=ctx.scale,
                norm_eps=ctx.eps, ln_grad="exact", products=ctx.products)
        return (grad_x, grad_ln_weight, grad_ln_bias, grad_qkv_weight, grad_qkv_bias,
                grad_out_weight, grad_out_bias, None, None, None, None)


def vision_attention(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias,
                     num_heads, eps, precision=None, gamma=None):
    """y = x + out_proj(attention(qkv(LayerNorm(x)))) for tensors of any floating dtype,
    inside or outside torch.autocast and torch.compile (see the module docstring; which
    computation runs is routing.route's decision): the fused backward (y in x's dtype,
    each gradient in its tensor's dtype), float32-grade, or at "medium" one product per
    matmul (natively for tensors all in one half dtype); at precision None inside an
    autocast region and for tensors all in one half dtype, the stock ops.

    x [B,S,E]; ln_weight, ln_bias [E]; qkv_weight [3E,E] (q | k | v rows); qkv_bias
    [3E]; out_weight [E,E]; out_bias [E]; gamma [E] or None: a LayerScale (timm,
    OpenCLIP) on the attention half, x + gamma * out_proj(...). On the fused path gamma
    is folded into the out projection in the compute dtype,
        x + gamma * (o W^T + b) = x + o (gamma[:, None] * W)^T + gamma * b,
    which autograd differentiates back into W, b and gamma; on the stock path it
    multiplies the projection's output, as the stock LayerScale does. B = 0 or S = 0
    give an empty y and zero parameter gradients."""
    check_precision(precision)
    params = (ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias)
    num_heads, eps = check_block_inputs(x, params, num_heads, eps, gamma)
    device = x.device
    layer_scale = () if gamma is None else (gamma,)
    head_dim = x.shape[-1] // num_heads
    autocast = torch.is_autocast_enabled(device.type)
    compiling = torch.compiler.is_compiling()
    backward = (torch.is_grad_enabled()
                and any(t.requires_grad for t in (x, *params, *layer_scale)))
    decision = routing.route(
        device_type=device.type, dtypes={t.dtype for t in (x, *params, *layer_scale)},
        x_dtype=x.dtype,
        autocast_dtype=torch.get_autocast_dtype(device.type) if autocast else None,
        precision=precision,
        float32_precision=(routing.float32_precision_now(compiling) if precision is None
                           else None),
        compiling=compiling,
        one_product=lambda dtype: one_product_supported(device, dtype, head_dim),
        fused_kernels=routing.fused_kernels_for(device, head_dim),
        deterministic=(torch.are_deterministic_algorithms_enabled()
                       and not routing.deterministic_warn_only() and backward),
        backward_batch=x.shape[0] if backward else None,
        # torch's flash forward refuses zero tokens: an empty batch keeps SDPA (the
        # shapes are read after `supported`, a constant: no guard where it is False)
        deterministic_attention=lambda dtype: (
            deterministic_sdpa.supported(device, dtype, head_dim) and x.numel() > 0
            and deterministic_sdpa.fits(x.shape[0], num_heads, x.shape[1], device)),
        torch_func=routing.torch_func_transform_active(compiling))
    if decision.stock:
        return stock_forward(x, *params, num_heads, eps, gamma,
                             decision.deterministic_attention)
    compute = decision.compute_dtype
    if gamma is not None:                    # folded into the out projection (above)
        scale = gamma.to(compute)
        out_weight = scale[:, None] * out_weight.to(compute)
        out_bias = scale * out_bias.to(compute)
    args = [t if t.dtype == compute else t.to(compute)
            for t in (x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias)]
    fused = (*args, num_heads, eps, decision.products)
    with autocast_off(device.type):
        if decision.opaque_ops:
            # inside torch.compile: the torch.library operators, opaque to dynamo
            check_fused_dtypes(args[0], args[1:], decision.products)
            y = block_ops.vision_attention(*fused)
        else:
            y = VisionAttentionFunction.apply(*fused, True)   # block inputs checked above
    return y if y.dtype == x.dtype else y.to(x.dtype)


class VisionAttentionBlock(nn.Module):
    """Pre-LayerNorm multi-head self-attention with a residual, no dropout.

    Parameters: norm.weight/bias [E], qkv.weight [3E,E] and qkv.bias [3E] (q | k | v
    rows), out_proj.weight [E,E] and out_proj.bias [E]. Load Molmo or CLIP weights with
    `load_molmo_state_dict` / `load_clip_state_dict`.

    Any floating dtype, torch.autocast and torch.compile work. precision None (the
    default) runs the stock ops inside an autocast region and for a block that is all
    bfloat16 or all float16 (there they were the faster; "medium" runs our one-product
    path: in the autocast dtype, or natively in the block's), and otherwise the fused
    path at torch.get_float32_matmul_precision() ("highest": float32-faithful, "high":
    faster, "medium": one bf16 product per matmul; inside torch.compile on a GPU, "high"
    training steps of one or two images run the stock ops); an explicit precision runs
    at that precision everywhere (see vitattn_bwd.module). On the fused float32 path the math is float32
    (float64 on the CPU for a float64 block), the output has x's dtype and each gradient
    its tensor's dtype; float64 on CUDA is refused in the forward, and double backward
    (create_graph=True) raises a RuntimeError (the stock path supports it where torch's
    SDPA backward does; its deterministic_sdpa attention refuses it, as torch's flash
    backward does).
    """

    def __init__(self, embed_dim=1024, num_heads=16, eps=1e-5, device=None, dtype=None,
                 precision=None):
        super().__init__()
        embed_dim, num_heads, eps = check_config(embed_dim, num_heads, eps)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.precision = check_precision(precision)
        factory = dict(device=device, dtype=dtype)
        self.norm = nn.LayerNorm(embed_dim, eps=eps, **factory)
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **factory)

    @property
    def eps(self):
        """The LayerNorm's epsilon: self.norm.eps, read at each call (as a swapped layer
        reads its own LayerNorm's), so that setting either one changes the block."""
        return self.norm.eps

    @eps.setter
    def eps(self, value):
        self.norm.eps = value

    def forward(self, x):
        check_x(x, self.embed_dim)
        return vision_attention(
            x, self.norm.weight, self.norm.bias, self.qkv.weight, self.qkv.bias,
            self.out_proj.weight, self.out_proj.bias, self.num_heads, self.eps,
            self.precision)

    def extra_repr(self):
        precision = "" if self.precision is None else f", precision={self.precision!r}"
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, eps={self.eps}"
                + precision)

    def load_molmo_state_dict(self, state_dict, prefix=""):
        """Load one Molmo vision block's attention weights: `attention_norm.*` and
        `attention.{wq,wk,wv,wo}.*` under `prefix`; other keys (feed_forward, ...) are
        ignored."""
        self.load_state_dict(convert_state_dict(state_dict, MOLMO_KEYS, prefix))

    def load_clip_state_dict(self, state_dict, prefix=""):
        """Load one CLIP / Hugging Face CLIPEncoderLayer's attention weights:
        `layer_norm1.*` and `self_attn.{q_proj,k_proj,v_proj,out_proj}.*` under `prefix`;
        other keys (mlp, layer_norm2, ...) are ignored."""
        self.load_state_dict(convert_state_dict(state_dict, CLIP_KEYS, prefix))


# Our parameter -> the source keys (concatenated in order along dim 0), per convention.
MOLMO_KEYS = {
    "norm.weight": ["attention_norm.weight"],
    "norm.bias": ["attention_norm.bias"],
    "qkv.weight": ["attention.wq.weight", "attention.wk.weight", "attention.wv.weight"],
    "qkv.bias": ["attention.wq.bias", "attention.wk.bias", "attention.wv.bias"],
    "out_proj.weight": ["attention.wo.weight"],
    "out_proj.bias": ["attention.wo.bias"],
}
CLIP_KEYS = {
    "norm.weight": ["layer_norm1.weight"],
    "norm.bias": ["layer_norm1.bias"],
    "qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                   "self_attn.v_proj.weight"],
    "qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "out_proj.weight": ["self_attn.out_proj.weight"],
    "out_proj.bias": ["self_attn.out_proj.bias"],
}


def convert_state_dict(state_dict, key_map, prefix=""):
    """Build a VisionAttentionBlock state dict from another convention's keys."""
    missing = [prefix + key for keys in key_map.values() for key in keys
               if prefix + key not in state_dict]
    if missing:
        raise KeyError(f"state_dict lacks {missing}")
    return {ours: torch.cat([state_dict[prefix + key] for key in theirs], dim=0)
            for ours, theirs in key_map.items()}
