"""VisionAttentionBlock: the attention half of a Molmo/CLIP vision-tower layer,
    y = x + out_proj(attention(qkv(LayerNorm(x)))),
whose backward is vitattn_bwd's fused backward (ln_grad="exact").

The forward is explicit eager PyTorch math that saves what the backward needs; the
largest saved tensor is the attention matrix P, B*H*S*S*4 bytes (21.3 MB per image at
577 tokens and 16 heads). Wrap the model in torch.compile to compile the forward too.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

from .api import attention_block_backward
from .reference import merge_heads, split_heads


def attention_block_forward(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight,
                            out_bias, num_heads, eps):
    """Forward math. Returns y and the tensors the backward needs."""
    x_mean = x.mean(-1, keepdim=True)                                          # [B,S,1]
    x_var = x.var(-1, unbiased=False, keepdim=True)                            # [B,S,1]
    x_norm = (x - x_mean) * torch.rsqrt(x_var + eps) * ln_weight + ln_bias     # [B,S,E]
    q, k, v = (split_heads(t, num_heads)                                       # [B,H,S,D]
               for t in F.linear(x_norm, qkv_weight, qkv_bias).chunk(3, dim=-1))
    scale = 1.0 / math.sqrt(q.shape[-1])
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)   # at least float32
    attn_weights = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1,
                                 dtype=softmax_dtype).to(q.dtype)              # [B,H,S,S]
    attn_output = merge_heads(attn_weights @ v)                                # [B,S,E]
    y = x + F.linear(attn_output, out_weight, out_bias)
    saved = (x, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v, attn_weights,
             attn_output, out_weight)
    return y, saved, scale


class VisionAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias,
                num_heads, eps):
        y, saved, scale = attention_block_forward(x, ln_weight, ln_bias, qkv_weight,
                                                  qkv_bias, out_weight, out_bias,
                                                  num_heads, eps)
        ctx.save_for_backward(*saved)
        ctx.num_heads, ctx.eps, ctx.scale = num_heads, eps, scale
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        (x, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v, attn_weights,
         attn_output, out_weight) = ctx.saved_tensors
        grads = attention_block_backward(
            grad_y.contiguous(), x, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v,
            attn_weights, attn_output, out_weight, ctx.scale, ctx.eps,
            num_heads=ctx.num_heads, ln_grad="exact")
        return (grads.grad_x, grads.grad_ln_weight, grads.grad_ln_bias,
                grads.grad_qkv_weight, grads.grad_qkv_bias, grads.grad_out_weight,
                grads.grad_out_bias, None, None)


class VisionAttentionBlock(nn.Module):
    """Pre-LayerNorm multi-head self-attention with a residual, no dropout.

    Parameters: norm.weight/bias [E], qkv.weight [3E,E] and qkv.bias [3E] (q | k | v
    rows), out_proj.weight [E,E] and out_proj.bias [E]. Load Molmo or CLIP weights with
    `load_molmo_state_dict` / `load_clip_state_dict`.
    """

    def __init__(self, embed_dim=1024, num_heads=16, eps=1e-5, device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by "
                             f"num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.eps = embed_dim, num_heads, eps
        factory = dict(device=device, dtype=dtype)
        self.norm = nn.LayerNorm(embed_dim, eps=eps, **factory)
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **factory)

    def forward(self, x):
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be [batch, tokens, {self.embed_dim}], "
                             f"got {tuple(x.shape)}")
        return VisionAttentionFunction.apply(
            x, self.norm.weight, self.norm.bias, self.qkv.weight, self.qkv.bias,
            self.out_proj.weight, self.out_proj.bias, self.num_heads, self.eps)

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, eps={self.eps}"

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
