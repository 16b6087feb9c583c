"""The backward of a pre-LayerNorm ViT attention block, as plain eager PyTorch.

Ground truth for the tests (run it in float64) and the statement of the math that the
compiled graph (graph.py) and the Triton kernels (kernels/softmax_bwd.py) must reproduce.

Forward, for reference:
    xhat   = (x - mean) / sqrt(var + eps)                     # [B,S,E]
    x_norm = xhat * ln_weight + ln_bias
    q,k,v  = split_heads(x_norm @ qkv_weight.T + qkv_bias)    # [B,H,S,D] each
    P      = softmax(scale * q @ k.T)                         # [B,H,S,S]
    attn   = merge_heads(P @ v)                               # [B,S,E]
    y      = x + attn @ out_weight.T + out_bias

Two LayerNorm input gradients (see README): "exact" is the true gradient, "contract" is
the benchmark contract's formula, whose last term lacks a 1/std factor.

Tests and benchmarks only: production code imports nothing from here (shared layouts live
in layout.py).
"""
import torch
from torch import nn
from torch.nn import functional as F

from .layout import LN_GRAD_MODES, merge_heads, split_heads


def layer_norm_backward(grad_output, grad_x_norm, x, x_mean, x_var, ln_weight, norm_eps,
                        ln_grad):
    """LayerNorm backward plus the residual: returns (grad_x, grad_ln_weight, grad_ln_bias)."""
    if ln_grad not in LN_GRAD_MODES:
        raise ValueError(f"ln_grad must be one of {LN_GRAD_MODES}, got {ln_grad!r}")
    std = torch.sqrt(x_var + norm_eps)                                 # [B,S,1]
    xhat = (x - x_mean) / std                                          # [B,S,E]
    grad_ln_weight = (grad_x_norm * xhat).sum((0, 1))                  # [E]
    grad_ln_bias = grad_x_norm.sum((0, 1))                             # [E]
    grad_xhat = grad_x_norm * ln_weight                                # [B,S,E]
    mean_grad = grad_xhat.mean(-1, keepdim=True)                       # [B,S,1]
    mean_grad_xhat = (grad_xhat * xhat).mean(-1, keepdim=True)         # [B,S,1]
    if ln_grad == "exact":
        grad_x_ln = (grad_xhat - mean_grad - xhat * mean_grad_xhat) / std
    else:
        grad_x_ln = (grad_xhat - mean_grad) / std - xhat * mean_grad_xhat
    return grad_output + grad_x_ln, grad_ln_weight, grad_ln_bias


def softmax_attention_backward(attn_weights, grad_attn, q, k, v, scale):
    """Attention core, the textbook way (materializes dP and dS).

    attn_weights [B,H,S,S]; grad_attn, q, k, v [B,H,S,D] -> grad_q, grad_k, grad_v [B,H,S,D].
    """
    grad_v = attn_weights.transpose(-1, -2) @ grad_attn
    grad_p = grad_attn @ v.transpose(-1, -2)                                   # [B,H,S,S]
    grad_s = attn_weights * (grad_p - (attn_weights * grad_p).sum(-1, keepdim=True))
    grad_q = (grad_s @ k) * scale
    grad_k = (grad_s.transpose(-1, -2) @ q) * scale
    return grad_q, grad_k, grad_v


def attention_block_backward(grad_output, x, x_mean, x_var, x_norm, ln_weight, qkv_weight,
                             q, k, v, attn_weights, attn_output, out_weight, scale, norm_eps,
                             num_heads=16, ln_grad="exact"):
    """All seven gradients, eager: (grad_x, grad_qkv_weight, grad_qkv_bias,
    grad_out_weight, grad_out_bias, grad_ln_weight, grad_ln_bias)."""
    B, S, E = x.shape
    rows = B * S
    grad_rows = grad_output.reshape(rows, E)                                   # [B*S,E]

    grad_out_weight = grad_rows.t() @ attn_output.reshape(rows, E)             # [E,E]
    grad_out_bias = grad_rows.sum(0)
    grad_attn = split_heads((grad_rows @ out_weight).view(B, S, E), num_heads)  # [B,H,S,D]

    grad_q, grad_k, grad_v = softmax_attention_backward(attn_weights, grad_attn, q, k, v,
                                                        scale)
    grad_qkv = torch.cat([merge_heads(grad_q), merge_heads(grad_k), merge_heads(grad_v)],
                         dim=-1).reshape(rows, 3 * E)                          # [B*S,3E]

    grad_x_norm = (grad_qkv @ qkv_weight).view(B, S, E)
    grad_qkv_weight = grad_qkv.t() @ x_norm.reshape(rows, E)                   # [3E,E]
    grad_qkv_bias = grad_qkv.sum(0)

    grad_x, grad_ln_weight, grad_ln_bias = layer_norm_backward(
        grad_output, grad_x_norm, x, x_mean, x_var, ln_weight, norm_eps, ln_grad)
    return (grad_x, grad_qkv_weight, grad_qkv_bias, grad_out_weight, grad_out_bias,
            grad_ln_weight, grad_ln_bias)


def block_forward(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias,
                  num_heads, eps):
    """The forward in stock PyTorch ops (LayerNorm, Linear, SDPA, Linear): autograd
    through it gives the exact-mode gradients, and it is the baseline of
    scripts/bench_towers.py --suite module."""
    B, S, E = x.shape
    h = F.layer_norm(x, (E,), ln_weight, ln_bias, eps)
    q, k, v = F.linear(h, qkv_weight, qkv_bias).view(B, S, 3, num_heads, E // num_heads) \
        .permute(2, 0, 3, 1, 4)                                                # [B,H,S,D]
    attn = F.scaled_dot_product_attention(q, k, v)                             # [B,H,S,D]
    return x + F.linear(merge_heads(attn), out_weight, out_bias)


class ReferenceBlock(nn.Module):
    """A VisionAttentionBlock's parameters (by name: norm, qkv, out_proj weights and
    biases) through block_forward and stock autograd."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        b = self.block
        return block_forward(x, b.norm.weight, b.norm.bias, b.qkv.weight, b.qkv.bias,
                             b.out_proj.weight, b.out_proj.bias, num_heads=b.num_heads,
                             eps=b.eps)
