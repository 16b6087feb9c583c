"""The public backward: argument checks (validation.py), then the compiled graph
(graph.py)."""
from typing import NamedTuple

import torch

from .graph import compiled_backward
from .precision import fused_products
from .validation import check_backward_inputs


class BlockGrads(NamedTuple):
    grad_x: torch.Tensor            # [B,S,E]
    grad_qkv_weight: torch.Tensor   # [3E,E]
    grad_qkv_bias: torch.Tensor     # [3E]
    grad_out_weight: torch.Tensor   # [E,E]
    grad_out_bias: torch.Tensor     # [E]
    grad_ln_weight: torch.Tensor    # [E]
    grad_ln_bias: torch.Tensor      # [E]


def attention_block_backward(grad_output, x, x_mean, x_var, x_norm, ln_weight, qkv_weight,
                             q, k, v, attn_weights, attn_output, out_weight, scale, norm_eps,
                             *, num_heads=16, ln_grad="exact", check_finite=False,
                             precision="high"):
    """Backward of a pre-LayerNorm ViT attention block (see README for the forward).

    Shapes: grad_output, x, x_norm, attn_output [B,S,E]; x_mean, x_var [B,S,1] (biased
    variance); ln_weight [E]; qkv_weight [3E,E]; q, k, v [B,H,S,D] (head-major);
    attn_weights [B,H,S,S] (softmax output); out_weight [E,E]. float32 (float64 on CPU).
    Non-contiguous inputs are copied once. Inputs are never modified.

    ln_grad="exact" is the true LayerNorm gradient; "contract" is the benchmark's formula.
    NaN/Inf inputs propagate to the outputs like in the eager math; check_finite=True
    rejects them with a ValueError instead (one extra pass over every input).
    precision: "high" (the default, whatever torch's float32 matmul precision: the
    fastest products the benchmark's tolerance allows; past 64 x 577 rows B*S, where the
    weight gradients' sums outgrow that tolerance's absolute term, it runs "highest") or
    "highest" (float32-faithful: every product fp16x3, the GEMMs with two-level
    accumulation, split_gemm.py); on the CPU the products are plain matmuls either way.
    """
    tensors = dict(grad_output=grad_output, x=x, x_mean=x_mean, x_var=x_var, x_norm=x_norm,
                   ln_weight=ln_weight, qkv_weight=qkv_weight, q=q, k=k, v=v,
                   attn_weights=attn_weights, attn_output=attn_output, out_weight=out_weight)
    inputs, scale, norm_eps, _ = check_backward_inputs(tensors, scale, norm_eps, num_heads,
                                                       ln_grad, precision, check_finite)
    inputs["probs"] = inputs.pop("attn_weights")           # P: the graph's name for it
    products = fused_products(precision)
    return BlockGrads(*compiled_backward(inputs, scale=scale, norm_eps=norm_eps,
                                         ln_grad=ln_grad, products=products))
