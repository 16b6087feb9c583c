"""The benchmark's entry point: 15 positional inputs, seven gradients, the contract's
LayerNorm formula (ln_grad="contract")."""
import torch

from .api import attention_block_backward


def heads_of(q, x, k=None, v=None):
    """num_heads as the contract passes it: q's dim 1, q being [B,H,S,D] (head-major).
    Checks q's layout first, so that a wrong q is blamed on q, not on a num_heads that
    the caller never passed; and where k and v share a shape that q does not, blames q."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor [B, H, S, D], got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, H, S, D] (head-major), got shape "
                         f"{tuple(q.shape)}")
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        B, S, E = x.shape
        H, D = q.shape[1], q.shape[3]
        if q.shape[2] != S or H * D != E:
            looks_sequence_major = q.shape[1] == S and q.shape[2] * q.shape[3] == E
            raise ValueError(
                f"q must be [B, H, S, D] (head-major; num_heads is read from its dim 1) with "
                f"S = {S} and H * D = {E} from x {tuple(x.shape)}, got shape "
                f"{tuple(q.shape)}"
                + ("; that is [B, S, H, D]: pass q.transpose(1, 2) (and k, v likewise)"
                   if looks_sequence_major else ""))
    if (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and k.shape == v.shape != q.shape):
        raise ValueError(f"q must have k's and v's shape {tuple(k.shape)} [B, H, S, D], got "
                         f"{tuple(q.shape)} (num_heads is read from q's dim 1)")
    return q.shape[1]


def run(grad_output, x, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v,
        attn_weights, attn_output, out_weight, scale, norm_eps):
    """Returns (grad_x, grad_qkv_weight, grad_qkv_bias, grad_out_weight, grad_out_bias,
    grad_ln_weight, grad_ln_bias) as a plain tuple."""
    return tuple(attention_block_backward(
        grad_output, x, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v,
        attn_weights, attn_output, out_weight, scale, norm_eps,
        num_heads=heads_of(q, x, k, v), ln_grad="contract"))
