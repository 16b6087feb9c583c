"""The fused block's forward and backward as two torch.library operators, so that inside
a user's torch.compile they are opaque operators of the user's graph, not graph breaks:

    torch.ops.vitattn_bwd.vision_attention_fwd(x, ln_weight, ln_bias, qkv_weight,
        qkv_bias, out_weight, out_bias, num_heads, eps, products)
        -> y [B,S,E], x_mean, x_var [B,S,1], qkv [B,S,3E], lse [B,H,S],
           attn_output [B,S,E]
    torch.ops.vitattn_bwd.vision_attention_bwd(grad_y, x, x_mean, x_var, ln_weight,
        ln_bias, qkv_weight, qkv, lse, attn_output, out_weight, scale, eps, products)
        -> grad_x, grad_ln_weight, grad_ln_bias, grad_qkv_weight, grad_qkv_bias,
           grad_out_weight, grad_out_bias

Their implementations are VisionAttentionFunction's (forward_graph.attention_block_forward
and graph.compiled_backward, our own graphs called from the user's); the forward's
autograd formula is the backward operator on the tensors it returns besides y
(SavedForBackward). `products` is a precision.Products' value (a schema takes strings,
not enums). Callers validate and cast the tensors first (module.vision_attention).
Eager calls use the autograd.Function instead, whose host time is lower (the operators
add the dispatcher's Python kernels and the register_autograd wrapper, ~+45-55 us per
forward and backward on a CPU core); the operators are defined through
torch.library.Library, not custom_op, whose wrapper cost ~0.22 ms of host time a call.
"""
import contextlib
import math

import torch

from . import graph
from .forward_graph import SavedForBackward, attention_block_forward, output_specs
from .precision import Products

_LIBRARY = torch.library.Library("vitattn_bwd", "FRAGMENT")
_LIBRARY.define(
    "vision_attention_fwd(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor qkv_weight, "
    "Tensor qkv_bias, Tensor out_weight, Tensor out_bias, int num_heads, float eps, "
    "str products) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIBRARY.define(
    "vision_attention_bwd(Tensor grad_y, Tensor x, Tensor x_mean, Tensor x_var, "
    "Tensor ln_weight, Tensor ln_bias, Tensor qkv_weight, Tensor qkv, Tensor lse, "
    "Tensor attn_output, Tensor out_weight, float scale, float eps, str products) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def autocast_off(device_type):
    """torch.autocast(device_type, enabled=False) inside an autocast region; elsewhere
    nothing, which costs less host time than entering a disabled autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _gradient_shapes(x):
    """The seven gradients' shapes, in the backward operator's order (all in x's
    dtype)."""
    E = x.shape[-1]
    return (x.shape, (E,), (E,), (3 * E, E), (3 * E,), (E, E), (E,))


def _contiguous(t, dtype):
    """t as a contiguous tensor of `dtype` (what the fake implementation promises); t
    itself where it is one already."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def vision_attention_fwd(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight,
                         out_bias, num_heads, eps, products):
    products = Products(products)
    # the caller's autocast region is still on when a compiled graph calls this; the
    # math runs as written (VisionAttentionFunction.forward)
    with autocast_off(x.device.type):
        y, saved, _ = attention_block_forward(x, ln_weight, ln_bias, qkv_weight, qkv_bias,
                                              out_weight, out_bias, num_heads, eps,
                                              products)
    got = (y, saved.x_mean, saved.x_var, saved.qkv, saved.lse, saved.attn_output)
    return tuple(_contiguous(t, dtype)
                 for t, (_, dtype) in zip(got, output_specs(x, num_heads, products)))


def vision_attention_bwd(grad_y, x, x_mean, x_var, ln_weight, ln_bias, qkv_weight, qkv,
                         lse, attn_output, out_weight, scale, eps, products):
    if x.numel() == 0:             # empty batch or no tokens: nothing to sum
        return tuple(x.new_zeros(shape) for shape in _gradient_shapes(x))
    saved = SavedForBackward(x, x_mean, x_var, ln_weight, ln_bias, qkv_weight, qkv, lse,
                             attn_output, out_weight)
    with autocast_off(x.device.type):
        (grad_x, grad_qkv_weight, grad_qkv_bias, grad_out_weight, grad_out_bias,
         grad_ln_weight, grad_ln_bias) = graph.compiled_backward(
            dict(grad_output=grad_y.contiguous(), **saved._asdict()), scale=scale,
            norm_eps=eps, ln_grad="exact", products=Products(products))
    return tuple(_contiguous(g, x.dtype) for g in (
        grad_x, grad_ln_weight, grad_ln_bias, grad_qkv_weight, grad_qkv_bias,
        grad_out_weight, grad_out_bias))


_LIBRARY.impl("vision_attention_fwd", vision_attention_fwd, "CompositeExplicitAutograd")
_LIBRARY.impl("vision_attention_bwd", vision_attention_bwd, "CompositeExplicitAutograd")


@torch.library.register_fake("vitattn_bwd::vision_attention_fwd", lib=_LIBRARY)
def _(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias, num_heads, eps,
      products):
    return tuple(x.new_empty(shape, dtype=dtype)
                 for shape, dtype in output_specs(x, num_heads, Products(products)))


@torch.library.register_fake("vitattn_bwd::vision_attention_bwd", lib=_LIBRARY)
def _(grad_y, x, x_mean, x_var, ln_weight, ln_bias, qkv_weight, qkv, lse, attn_output,
      out_weight, scale, eps, products):
    return tuple(x.new_empty(shape) for shape in _gradient_shapes(x))


def _setup_context(ctx, inputs, output):
    x, ln_weight, ln_bias, qkv_weight, _, out_weight, _, num_heads, eps, products = inputs
    _, x_mean, x_var, qkv, lse, attn_output = output
    ctx.save_for_backward(x, x_mean, x_var, ln_weight, ln_bias, qkv_weight, qkv, lse,
                          attn_output, out_weight)
    ctx.mark_non_differentiable(x_mean, x_var, qkv, lse, attn_output)
    ctx.scale = 1.0 / math.sqrt(x.shape[-1] // num_heads)
    ctx.eps, ctx.products = eps, products


def _backward(ctx, grad_y, *unused):
    grads = torch.ops.vitattn_bwd.vision_attention_bwd(
        grad_y, *ctx.saved_tensors, ctx.scale, ctx.eps, ctx.products)
    return (*grads, None, None, None)


torch.library.register_autograd("vitattn_bwd::vision_attention_fwd", _backward,
                                setup_context=_setup_context, lib=_LIBRARY)


def vision_attention(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias,
                     num_heads, eps, products):
    """y of the forward operator (with the backward operator as its autograd formula),
    for validated tensors (module docstring) at `products` (a precision.Products)."""
    return torch.ops.vitattn_bwd.vision_attention_fwd(
        x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias, num_heads,
        eps, products.value)[0]
