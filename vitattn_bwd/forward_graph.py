"""VisionAttentionBlock's forward as explicit PyTorch math, compiled by Inductor on CUDA.

    block_forward(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias,
                  num_heads=, eps=, products=)
        -> y [B,S,E], x_mean, x_var [B,S,1], qkv [B,S,3E], lse [B,H,S],
           attn_output [B,S,E]

LayerNorm, the QKV projection, the fused attention operator (attention_fwd.py: no S x S
tensor, saves the log-sum-exp) and the out projection with the residual, at `products`
(a precision.Products). With BF16X3 (precision "high"; CUDA, float32) both projections
are bf16x3 GEMMs from rounded splits (precision.py), with FP16X3 ("highest")
split_gemm.py's fp16x3 GEMMs; each activation is split by the kernel that makes it, the
weights once per call, and q, k, v reach the attention operator as bf16 halves (cuBLAS
float32 GEMMs without TF32 take about fifteen times as long per FLOP). With PLAIN (the
CPU, float64) the projections are F.linear in the inputs' dtype. With ONE_BF16 or
ONE_FP16 (precision "medium") the LayerNorm is float32 and the rest one product each in
that half dtype, as the stock block under autocast.

`attention_block_forward` is what VisionAttentionFunction calls: on CUDA (float32) the
compiled graph, per configuration and batch bucket as the backward's (graph.py), small
batches replayed as CUDA graphs (cuda_graphs.py); elsewhere, or for an empty batch, the
same math eagerly with F.linear.
"""
import functools
import math
from typing import NamedTuple

import torch
from torch.nn import functional as F

from . import cache, graph
from .softmax_bwd import triton_supports
from .attention_fwd import attention_fwd, attention_fwd_half, attention_fwd_split
from .errors import out_of_memory_as_such
from .layout import qkv_heads
from .precision import HALF_DTYPES, Products, linear_bf16x3, operand_split
from .split_gemm import linear_fp16x3


class SavedForBackward(NamedTuple):
    """What the forward saves for the backward, named as graph.compiled_backward takes
    them: x [B,S,E], its LayerNorm statistics x_mean, x_var [B,S,1], the LayerNorm
    parameters, qkv_weight [3E,E], the QKV projection qkv [B,S,3E], the softmax's row
    log-sum-exp lse [B,H,S], the attention output [B,S,E] and out_weight
    [E,E]."""
    x: torch.Tensor
    x_mean: torch.Tensor
    x_var: torch.Tensor
    ln_weight: torch.Tensor
    ln_bias: torch.Tensor
    qkv_weight: torch.Tensor
    qkv: torch.Tensor
    lse: torch.Tensor
    attn_output: torch.Tensor
    out_weight: torch.Tensor


def _linear_in(dtype):
    """F.linear with its input, weight and bias cast to `dtype`: one product in it with
    float32 accumulation, what a Linear computes under autocast to `dtype`."""
    def linear(a, weight, bias):
        return F.linear(a.to(dtype), weight.to(dtype), bias.to(dtype))
    return linear


def block_forward(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias, *,
                  num_heads, eps, products):
    """y and the tensors the backward needs (no x_norm, no P). With one product
    (products.half_dtype, bf16 or fp16; x and the parameters float32, or all of
    half_dtype): the LayerNorm in float32, then
    the projections and the attention one product each in half_dtype, with float32
    accumulation, as the stock block computes them under autocast to half_dtype (or in
    a half_dtype block); qkv and attn_output are saved in it, y has x's dtype."""
    # a bf16 / fp16 block's LayerNorm statistics in float32, as torch's LayerNorm takes
    # them (the upcast stays in the kernel's registers)
    x_stats = x.float() if x.dtype in HALF_DTYPES else x
    x_mean = x_stats.mean(-1, keepdim=True)                                    # [B,S,1]
    x_centered = x_stats - x_mean
    x_var = (x_centered * x_centered).mean(-1, keepdim=True)      # [B,S,1], biased
    x_norm = x_centered * torch.rsqrt(x_var + eps) * ln_weight + ln_bias       # [B,S,E]
    head_dim = x.shape[-1] // num_heads
    scale = 1.0 / math.sqrt(head_dim)
    half_dtype = products.half_dtype
    if half_dtype is not None:
        linear = _linear_in(half_dtype)
        qkv = linear(x_norm, qkv_weight, qkv_bias)                             # [B,S,3E]
        q, k, v = qkv_heads(qkv, num_heads)                                   # [B,H,S,D]
        attn_output, lse = attention_fwd_half(q, k, v, scale)    # [B,S,E], [B,H,S]
        y = x + linear(attn_output, out_weight, out_bias)
        return y, x_mean, x_var, qkv, lse, attn_output
    linear = {Products.BF16X3: linear_bf16x3,
              Products.FP16X3: linear_fp16x3}.get(products, F.linear)
    qkv = linear(x_norm, qkv_weight, qkv_bias)                                 # [B,S,3E]
    if products is not Products.PLAIN and triton_supports("cuda", x.dtype, head_dim):
        # the attention kernel's bf16 split, fused where qkv is made
        attn_output, lse = attention_fwd_split(*operand_split(products)(qkv),
                                               num_heads, scale)    # [B,S,E], [B,H,S]
    else:
        q, k, v = qkv_heads(qkv, num_heads)                                   # [B,H,S,D]
        attn_output, lse = attention_fwd(q, k, v, scale)
    y = x + linear(attn_output, out_weight, out_bias)
    return y, x_mean, x_var, qkv, lse, attn_output


def output_specs(x, num_heads, products):
    """(shape, dtype) of each of block_forward's outputs for x [B,S,E] at `products`: y
    in x's dtype; the LayerNorm statistics in float32 for a half-precision x, else in
    x's; qkv and attn_output in the half dtype on the one-product path, else in x's; the
    log-sum-exp in float32 there (torch's flash forward gives it so), else in x's."""
    B, S, E = x.shape
    half_dtype = products.half_dtype
    stats = torch.float32 if x.dtype in HALF_DTYPES else x.dtype
    activations = x.dtype if half_dtype is None else half_dtype
    lse = x.dtype if half_dtype is None else torch.float32
    return (((B, S, E), x.dtype), ((B, S, 1), stats), ((B, S, 1), stats),
            ((B, S, 3 * E), activations), ((B, num_heads, S), lse),
            ((B, S, E), activations))


@functools.cache
def _compile(device, dtype, seq_len, embed_dim, num_heads, eps, batch_bucket, cuda_graph,
             products):
    """The compiled forward of one configuration and batch bucket (CUDA); the arguments
    are the cache key (device with its index, as graph._compile's)."""
    del device, dtype, seq_len, embed_dim                      # they key the cache only

    def forward_graph(**tensors):
        return block_forward(**tensors, num_heads=num_heads, eps=eps, products=products)
    return graph.compile_graph(forward_graph, "cuda", f"forward-{products.graph_tag}",
                               batch_bucket, ("x",), cuda_graph)


def attention_block_forward(x, ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight,
                            out_bias, num_heads, eps, products):
    """y, the tensors saved for the backward (SavedForBackward) and the softmax scale,
    for validated tensors of one device and dtype, at `products` (a precision.Products;
    block_forward)."""
    cache.load_env_cache_once()        # a bad VITATTN_BWD_CACHE raises here, not later
    tensors = dict(x=x, ln_weight=ln_weight, ln_bias=ln_bias, qkv_weight=qkv_weight,
                   qkv_bias=qkv_bias, out_weight=out_weight, out_bias=out_bias)
    B, S, E = x.shape
    if x.numel() == 0:
        # an empty batch or no tokens: empty outputs, no kernel (torch's flash-attention
        # forward does not take zero tokens)
        outputs = tuple(x.new_empty(shape, dtype=dtype)
                        for shape, dtype in output_specs(x, num_heads, products))
    elif x.is_cuda:
        fn = _compile(x.device, x.dtype, S, E, num_heads, eps, graph.batch_bucket(B),
                      graph.uses_cuda_graph("cuda", B), products)
        outputs = _run_compiled(fn, tensors)
    else:
        outputs = block_forward(**tensors, num_heads=num_heads, eps=eps,
                                products=products.on_device(x.device.type))
    y, x_mean, x_var, qkv, lse, attn_output = outputs
    saved = SavedForBackward(x, x_mean, x_var, ln_weight, ln_bias, qkv_weight, qkv, lse,
                             attn_output, out_weight)
    return y, saved, 1.0 / math.sqrt(E // num_heads)


@torch.compiler.disable
@out_of_memory_as_such
def _run_compiled(fn, tensors):
    """Opaque to an enclosing torch.compile (of a model using VisionAttentionBlock): our
    graph is compiled on its own, with its own options. A device out-of-memory, in the
    compile or the run, raises torch.OutOfMemoryError (errors.py)."""
    return fn(**tensors)
