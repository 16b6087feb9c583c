"""Test helpers: the float64 reference, relative errors, and a plain-PyTorch block
(LayerNorm, Linear, SDPA) whose autograd gradients the fused backward must match."""
import torch
from torch.nn import functional as F

from vitattn_bwd import reference


def reference_grads(inputs, num_heads, ln_grad, dtype=torch.float64, device="cpu"):
    args = {name: (t.to(device=device, dtype=dtype) if torch.is_tensor(t) else t)
            for name, t in inputs.items()}
    return reference.attention_block_backward(**args, num_heads=num_heads, ln_grad=ln_grad)


def relative_errors(outputs, refs):
    return [((o.double() - r.double()).norm() / r.double().norm()).item()
            for o, r in zip(outputs, refs)]


def plain_block_forward(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias,
                        num_heads, eps):
    B, S, E = x.shape
    h = F.layer_norm(x, (E,), ln_weight, ln_bias, eps)
    q, k, v = F.linear(h, qkv_weight, qkv_bias).view(B, S, 3, num_heads, E // num_heads) \
        .permute(2, 0, 3, 1, 4)                                                # [B,H,S,D]
    o = F.scaled_dot_product_attention(q, k, v)
    return x + F.linear(o.transpose(1, 2).reshape(B, S, E), out_weight, out_bias)
