"""The benchmark's entry point: 15 positional inputs, seven gradients, the contract's
LayerNorm formula (ln_grad="contract")."""
from .api import attention_block_backward


def run(grad_output, x, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v,
        attn_weights, attn_output, out_weight, scale, norm_eps):
    """Returns (grad_x, grad_qkv_weight, grad_qkv_bias, grad_out_weight, grad_out_bias,
    grad_ln_weight, grad_ln_bias) as a plain tuple."""
    num_heads = q.shape[1]
    return tuple(attention_block_backward(
        grad_output, x, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v,
        attn_weights, attn_output, out_weight, scale, norm_eps,
        num_heads=num_heads, ln_grad="contract"))
