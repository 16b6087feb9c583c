"""The backward as explicit PyTorch math (`block_backward`), compiled once per
configuration by Inductor (`compiled_backward`).

On CUDA (float32) every product is float32-grade from operands split once
(precision.py): cuBLAS bf16 GEMMs around the two attention-core operators
(softmax_bwd.py, lowered to our kernels by inductor.py), the QKV weight gradient one
fp16 GEMM of operands brought into fp16's range by a power-of-two scale (precision
"high"); "highest" runs fp16x3 products (split_gemm.py). The LayerNorm backward and the
sums of its parameters' gradients are one Triton kernel (layer_norm_bwd.py). Elsewhere (the
CPU, float64) the products are plain and Inductor fuses the rest.

One compiled graph per configuration and batch bucket: batch 1 static, batches 2-15 and
16+ each one dynamic-batch graph (max-autotune tunes at the first size it sees, so small
and large batches do not share tiles); on CUDA the 2-15 bucket compiles twice, replayed
as CUDA graphs up to CUDA_GRAPH_MAX_BATCH and run directly above, both under the
bucket's cache tag. fullgraph=True: exceeding dynamo's recompile
limit raises instead of running eager code. On CUDA the graphs launch their kernels from
Inductor's C++ wrapper, and the smallest batches replay as CUDA graphs (cuda_graphs.py).
Every option is given per compile: no process-wide setting changes, beyond what Inductor
does at any compile (it raises Python's recursion limit to at least 2000, and loading
C++ code, as the CPU's kernels and the C++ wrapper are, sets the private environment
variable _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR that such code reads).
"""
import functools
import os
import types

import torch

from . import cache, layer_norm_bwd, softmax_bwd
from .cuda_graphs import GraphedCall
from .errors import out_of_memory_as_such
from .layout import qkv_heads
from .precision import (HALF_DTYPES, Products, bf16_halves, matmul_fp16_transposed,
                        matmul_halves_by_weight, matmul_halves_transposed, mm_float32,
                        mm_half, power_of_two_scale, products_halves_by_weight,
                        split_bf16_truncated)
from .split_gemm import fp16_halves, matmul_fp16x3, transposed
from .validation import check_probs_or_lse

# Batch sizes >= 2 that share a dynamic-batch graph, each bucket its own torch.compile
# object: (smallest, largest).
BATCH_BUCKETS = ((2, 15), (16, float("inf")))
# Batches up to this size replay as CUDA graphs: launched from the C++ wrapper, their
# calls still take longer on the host than on the GPU (performance.md, "Host time").
CUDA_GRAPH_MAX_BATCH = 3
# Devices whose graphs launch their kernels from Inductor's C++ wrapper, with no Python
# per kernel (performance.md, "Host time").
CPP_WRAPPER_DEVICES = ("cuda",)
BATCHED_INPUTS = ("grad_output", "x", "x_mean", "x_var", "x_norm", "q", "k", "v", "qkv",
                  "probs", "lse", "attn_output")   # those present are marked dynamic
# Rows (B*S) up to which bf16x3 (precision "high") keeps the contract's margins with P
# given: the weight gradients' sums grow with the rows while the tolerance's absolute
# term stays 1e-2 (batch 420 missed 0.4% of grad_qkv_weight; batch 56 matched 0.99996).
# Past these rows the contract's "high" runs fp16x3 ("highest"; precision.md, `"high"`).
HIGH_PRECISION_MAX_ROWS = 64 * 577


def _high_products(grad_rows, attn_rows, x_norm_rows, out_weight, qkv_weight,
                   probs, lse, forward_output, q, k, v, scale, products):
    """Out projection, attention core and QKV projection from split operands at
    precision "high" (CUDA): returns grad_out_weight, grad_x_norm_parts (four [B*S,E]
    GEMM outputs, whose sum times `unscale` is grad_x_norm), grad_qkv_weight,
    grad_qkv_bias, unscale. One of probs (P) and lse (its log-sum-exp) is given, the
    other None; forward_output: the attention output [B,S,E] where it goes with lse
    (the module's), else None. The GEMMs' float32
    operands are split by truncation, and the QKV weight gradient is one fp16 product.
    products: Products.BF16X3, for the attention core."""
    split = split_bf16_truncated
    B, H, S, D = q.shape
    E = H * D
    rows = B * S
    # Every gradient here is linear in grad_rows. Scaled by a power of two that brings
    # its largest element into [1, 2), the fp16 copies of dQ, dK, dV (the QKV weight
    # gradient's operands) keep their precision whatever the loss's scale: a mean loss
    # gives gradients of 1e-7 and below, where fp16 has few or no bits left (the
    # gradient's error was 5e-2 at 1e-5 and 1.0 at 1e-7 on the H200). The products are
    # scaled back exactly at the end.
    scale_up = power_of_two_scale(grad_rows)
    grad_rows = grad_rows * scale_up
    grad_rows_halves = bf16_halves(grad_rows, split)                           # [B*S,2E]
    grad_out_weight = matmul_halves_transposed(grad_rows_halves,
                                               bf16_halves(attn_rows, split))
    grad_attn = matmul_halves_by_weight(grad_rows_halves, out_weight, split).view(B, S, E)

    # the core's gradients in fp16 and as bf16 halves, and their partial sums over rows
    grad_q16, grad_q_halves, delta, grad_q_sums = softmax_bwd.softmax_bwd_rows(
        grad_attn, q, k, v, forward_output, scale, products.value, probs,
        lse)                                      # [B,S,E], [B,S,2E], [B,H,S], [B,G,E]
    grad_kv16, grad_kv_halves, grad_kv_sums = softmax_bwd.softmax_bwd_cols(
        grad_attn, q, k, v, delta, scale, products.value, probs,
        lse)                                            # [B,S,2E], [B,S,4E], [B,G,2E]
    grad_q_halves = grad_q_halves.view(rows, 2 * E)
    grad_kv_halves = grad_kv_halves.view(rows, 4 * E)

    grad_x_norm_parts = (products_halves_by_weight(grad_q_halves, qkv_weight[:E], split)
                         + products_halves_by_weight(grad_kv_halves, qkv_weight[E:], split))
    x_norm16 = x_norm_rows.half()
    grad_qkv_weight = torch.cat([                                              # [3E,E]
        matmul_fp16_transposed(grad_q16.view(rows, E), x_norm16),
        matmul_fp16_transposed(grad_kv16.view(rows, 2 * E), x_norm16)])
    grad_qkv_bias = torch.cat([grad_q_sums.sum((0, 1)), grad_kv_sums.sum((0, 1))])  # [3E]
    unscale = 1 / scale_up
    return (grad_out_weight * unscale, grad_x_norm_parts, grad_qkv_weight * unscale,
            grad_qkv_bias * unscale, unscale)


def _highest_products(grad_rows, attn_rows, x_norm_rows, out_weight, qkv_weight,
                      probs, lse, forward_output, q, k, v, scale, products):
    """The same products at precision "highest" (CUDA), float32-faithful: every GEMM
    fp16x3 from scaled fp16 halves with two-level accumulation (split_gemm.py), the
    attention core fp16x3 on the scaled fp16 halves of its operands
    (softmax_bwd.fp16_operand_scales), which writes float32 gradients. Each operand is
    split once for the GEMMs that read it (grad_rows, grad_q and grad_kv twice, once as
    a transposed view). products: Products.FP16X3. Returns what _high_products returns,
    with two grad_x_norm parts."""
    B, H, S, D = q.shape
    E = H * D
    rows = B * S
    grad_rows_halves = fp16_halves(grad_rows)                                  # [B*S,E]
    grad_out_weight = matmul_fp16x3(transposed(grad_rows_halves),
                                    fp16_halves(attn_rows))                    # [E,E]
    grad_attn = matmul_fp16x3(grad_rows_halves, fp16_halves(out_weight)).view(B, S, E)
    # the core's float32 gradients and their partial sums over rows
    operand_scales = softmax_bwd.fp16_operand_scales(grad_attn, q, k, v)     # [5]
    grad_q, _, delta, grad_q_sums = softmax_bwd.softmax_bwd_rows(
        grad_attn, q, k, v, forward_output, scale, products.value, probs, lse,
        operand_scales)                                 # [B,S,E], [B,H,S], [B,G,E]
    grad_kv, _, grad_kv_sums = softmax_bwd.softmax_bwd_cols(
        grad_attn, q, k, v, delta, scale, products.value, probs, lse,
        operand_scales)                                 # [B,S,2E], [B,G,2E]
    grad_q_halves = fp16_halves(grad_q.view(rows, E))                          # [B*S,E]
    grad_kv_halves = fp16_halves(grad_kv.view(rows, 2 * E))                    # [B*S,2E]
    x_norm_halves = fp16_halves(x_norm_rows)
    grad_x_norm_parts = (matmul_fp16x3(grad_q_halves, fp16_halves(qkv_weight[:E])),
                         matmul_fp16x3(grad_kv_halves, fp16_halves(qkv_weight[E:])))
    grad_qkv_weight = torch.cat([                                              # [3E,E]
        matmul_fp16x3(transposed(grad_q_halves), x_norm_halves),
        matmul_fp16x3(transposed(grad_kv_halves), x_norm_halves)])
    grad_qkv_bias = torch.cat([grad_q_sums.sum((0, 1)), grad_kv_sums.sum((0, 1))])  # [3E]
    return (grad_out_weight, grad_x_norm_parts, grad_qkv_weight, grad_qkv_bias,
            grad_out_weight.new_ones(()))


def _medium_products(grad_rows, attn_rows, x_norm_rows, out_weight, qkv_weight,
                     probs, lse, forward_output, q, k, v, scale, products):
    """The products at one product per matmul (products: ONE_BF16 or ONE_FP16) in the
    dtype of the module's saved half-precision activations (attn_rows, q, k, v;
    VisionAttentionBlock at precision "medium"), with float32 accumulation, as the stock
    block's autocast backward computes them: grad_out_weight, grad_x_norm_parts (two
    float32 [B*S,E] GEMM outputs whose sum is grad_x_norm), grad_qkv_weight,
    grad_qkv_bias, unscale (1). The weight gradients and grad_x_norm leave their GEMMs
    in float32 (the stock block rounds them to the half dtype)."""
    dtype = products.half_dtype
    B, H, S, D = q.shape
    E = H * D
    rows = B * S
    grad_rows = grad_rows.to(dtype)                                            # [B*S,E]
    grad_out_weight = mm_float32(grad_rows.t(), attn_rows)                     # [E,E]
    grad_attn = mm_half(grad_rows, out_weight.to(dtype)).view(B, S, E)
    # the core's gradients in `dtype`, and their partial sums over rows
    grad_q, _, delta, grad_q_sums = softmax_bwd.softmax_bwd_rows(
        grad_attn, q, k, v, forward_output, scale, products.value, probs,
        lse)                                                # [B,S,E], [B,H,S], [B,G,E]
    grad_kv, _, grad_kv_sums = softmax_bwd.softmax_bwd_cols(
        grad_attn, q, k, v, delta, scale, products.value, probs,
        lse)                                                # [B,S,2E], [B,G,2E]
    grad_q, grad_kv = grad_q.view(rows, E), grad_kv.view(rows, 2 * E)
    qkv_weight = qkv_weight.to(dtype)
    grad_x_norm_parts = (mm_float32(grad_q, qkv_weight[:E]),
                         mm_float32(grad_kv, qkv_weight[E:]))
    x_norm_rows = x_norm_rows.to(dtype)
    grad_qkv_weight = torch.cat([mm_float32(grad_q.t(), x_norm_rows),          # [3E,E]
                                 mm_float32(grad_kv.t(), x_norm_rows)])
    grad_qkv_bias = torch.cat([grad_q_sums.sum((0, 1)), grad_kv_sums.sum((0, 1))])  # [3E]
    return (grad_out_weight, grad_x_norm_parts, grad_qkv_weight, grad_qkv_bias,
            grad_out_weight.new_ones(()))


def _plain_products(grad_rows, attn_rows, x_norm_rows, out_weight, qkv_weight,
                    probs, lse, forward_output, q, k, v, scale, products):
    """The same products in the inputs' own precision (products: Products.PLAIN; the
    CPU, float64): grad_out_weight, grad_x_norm_parts (grad_x_norm [B*S,E] alone),
    grad_qkv_weight, grad_qkv_bias, unscale (1)."""
    B, H, S, D = q.shape
    E = H * D
    grad_out_weight = grad_rows.t() @ attn_rows
    grad_attn = (grad_rows @ out_weight).view(B, S, E)
    grad_qkv = torch.cat(softmax_bwd.attention_backward_math(                 # [B*S,3E]
        grad_attn, q, k, v, scale, probs=probs, lse=lse, attn_output=forward_output),
        dim=-1).view(B * S, 3 * E)
    return (grad_out_weight, (grad_qkv @ qkv_weight,), grad_qkv.t() @ x_norm_rows,
            grad_qkv.sum(0), 1.0)


# The function computing block_backward's products, for each Products
_PRODUCTS_OF = {Products.PLAIN: _plain_products, Products.ONE_BF16: _medium_products,
                Products.ONE_FP16: _medium_products, Products.BF16X3: _high_products,
                Products.FP16X3: _highest_products}


def _layer_norm_backward_of_parts(grad_output, grad_x_norm_parts, unscale, x, x_mean,
                                  x_var, ln_weight, norm_eps, ln_grad):
    """grad_x, grad_ln_weight, grad_ln_bias, grad_out_bias from grad_x_norm given as the
    GEMM outputs it is the sum of (four or two on CUDA, times unscale): the fused
    LayerNorm operator on CUDA, the math elsewhere."""
    if x.is_cuda:
        missing = (None,) * (4 - len(grad_x_norm_parts))       # two parts: part2, part3
        return layer_norm_bwd.fused_layer_norm_backward(
            grad_output, *grad_x_norm_parts, *missing, unscale, x, x_mean, x_var,
            ln_weight, norm_eps, ln_grad == "exact")
    B, S, E = x.shape
    grad_x_norm = functools.reduce(torch.add, grad_x_norm_parts) * unscale
    grad_x, grad_ln_weight, grad_ln_bias = layer_norm_bwd.layer_norm_backward(
        grad_output, grad_x_norm.view(B, S, E), x, x_mean, x_var, ln_weight, norm_eps,
        ln_grad)
    # summed in grad_x_norm's dtype (float32 or float64), never in bf16 / fp16
    grad_out_bias = grad_output.reshape(B * S, E).to(grad_x_norm.dtype).sum(0)
    return grad_x, grad_ln_weight, grad_ln_bias, grad_out_bias


def block_backward(grad_output, x, x_mean, x_var, ln_weight, qkv_weight, attn_output,
                   out_weight, *, scale, norm_eps, ln_grad, products, probs=None,
                   lse=None, q=None, k=None, v=None, qkv=None, x_norm=None, ln_bias=None):
    """The seven gradients (the math of reference.attention_block_backward).

    products (a precision.Products): PLAIN for plain products in the inputs' dtype (the
    CPU, float64; _plain_products), BF16X3 or FP16X3 for the split products of CUDA
    float32 (_high_products, _highest_products), ONE_BF16 or ONE_FP16 where the
    module saved its activations (qkv, attn_output) in that dtype, one product in it
    (_medium_products, on any device); for a block all in bf16 or fp16 (x in that
    dtype), every gradient is returned in that dtype.

    One of probs, P [B,H,S,S] (the contract's), and lse, its row log-sum-exp [B,H,S]
    (VisionAttentionBlock saves only that; the attention core recomputes P), is given.
    q, k, v [B,H,S,D] may instead come whole as the QKV projection qkv [B,S,3E] (the
    module saves it so: one contiguous
    tensor for a CUDA graph's static input, not three strided views). x_norm may be left
    out (None) with ln_bias given: it is recomputed from x and the LayerNorm
    statistics."""
    B, S, E = x.shape
    if qkv is not None:
        q, k, v = qkv_heads(qkv, (probs if lse is None else lse).shape[1])    # [B,H,S,D]
    if x_norm is None:
        x_norm = (x - x_mean) * torch.rsqrt(x_var + norm_eps) * ln_weight + ln_bias
    grad_rows = grad_output.reshape(B * S, E)                                  # [B*S,E]
    # with lse (module mode) attn_output is the block's own O = P v, whose rowsum with
    # dO is delta; the contract's attn_output is drawn apart from its P
    forward_output = None if lse is None else attn_output
    (grad_out_weight, grad_x_norm_parts, grad_qkv_weight, grad_qkv_bias,
     unscale) = _PRODUCTS_OF[products](
        grad_rows, attn_output.reshape(B * S, E), x_norm.reshape(B * S, E), out_weight,
        qkv_weight, probs, lse, forward_output, q, k, v, scale, products)
    grad_x, grad_ln_weight, grad_ln_bias, grad_out_bias = _layer_norm_backward_of_parts(
        grad_output, grad_x_norm_parts, unscale, x, x_mean, x_var, ln_weight, norm_eps,
        ln_grad)
    grads = (grad_x, grad_qkv_weight, grad_qkv_bias, grad_out_weight, grad_out_bias,
             grad_ln_weight, grad_ln_bias)
    # a bf16 / fp16 block: each gradient rounded once, from float32, to the block's dtype
    return tuple(g.to(x.dtype) for g in grads) if x.dtype in HALF_DTYPES else grads


def uses_cuda_graph(device_type, batch):
    """Whether a call replays as a CUDA graph (cuda_graphs.py): on CUDA, batches up to
    CUDA_GRAPH_MAX_BATCH, whose GPU work is shorter than their launches even from C++.
    Larger batches run without: a graph's input copies (P is 21 MB an image) would cost
    more than the launches they hide."""
    return device_type == "cuda" and batch <= CUDA_GRAPH_MAX_BATCH


def _max_autotune(device_type):
    """Max-autotune on CUDA, unless VITATTN_BWD_COMPILE_MODE=default (tests of odd
    shapes: minutes less compiling; the attention-core templates still tune)."""
    return (device_type == "cuda"
            and os.environ.get("VITATTN_BWD_COMPILE_MODE", "max-autotune") != "default")


def compile_graph(fn, device_type, name, batch_bucket, batched_inputs, cuda_graph):
    """fn(**tensors) compiled for one batch bucket, with its own options. batch_bucket
    None is batch 1 (static shapes); otherwise dimension 0 of the `batched_inputs` (names
    of fn's keyword arguments) present in a call is the dynamic batch. The tag `name`
    plus the bucket's smallest batch distinguishes this graph in Inductor's cache key
    besides our sources. fn is compiled as a copy with a code object of its own: dynamo
    keeps its compiled graphs, and counts them against its recompile limit (8), per code
    object, and reuses any whose guards pass, so one code object per configuration and
    bucket keeps each to a graph or two and keeps one bucket's dynamic graph, tuned for
    its sizes, from serving another. fullgraph=True: exceeding the limit raises instead
    of silently running eager code. With cuda_graph, each input signature is replayed as
    a CUDA graph (cuda_graphs.py), captured again, fn compiling again, after
    torch._dynamo.reset() dropped fn's graphs. Each input reaches the compiled function
    as a plain tensor that does not require grad (a detached view), in row-major strides
    (a copy where it has others): dynamo guards on a tensor's type, requires_grad and
    strides, so a module's nn.Parameter in one call and the same weight as a plain tensor in another
    (eager against torch.compile(model)'s saved tensors) would each compile a graph of
    their own, and so would every new layout of a caller's tensor (a transposed or
    sliced x), and the ninth would raise. A second graph would also be a compile
    inside the caller's CUDA-graph capture (torch.compile's "reduce-overhead"), which
    a capture does not allow: GraphedCall's signature ignores type and requires_grad,
    so it runs fn there for a signature it captured from the Parameters of an eager
    call."""
    cache.load_env_cache_once()
    # importing inductor registers the lowerings
    from .inductor import compile_options, cudagraph_trees_warming_up, holds_compiled_graphs
    smallest_batch = 1 if batch_bucket is None else batch_bucket[0]
    options = compile_options(f"{cache.cache_key_tag()}-{name}batch{smallest_batch}",
                              max_autotune=_max_autotune(device_type),
                              cpp_wrapper=device_type in CPP_WRAPPER_DEVICES)
    own_fn = _with_own_code(fn)
    compiled = torch.compile(own_fn, fullgraph=True, dynamic=False, options=options)
    dynamic_inputs = () if batch_bucket is None else batched_inputs

    def run(**tensors):
        for input_name in dynamic_inputs:
            if input_name in tensors:
                # a tensor object of its own (detached below): the caller's x or gradient
                # marked would have its batch dynamic in the caller's graphs too
                torch._dynamo.mark_dynamic(tensors[input_name], 0)
        return compiled(**tensors)
    call = (GraphedCall(run, lambda: holds_compiled_graphs(own_fn.__code__),
                        pool_taken=cudagraph_trees_warming_up) if cuda_graph
            else run)
    # detach: a plain tensor object of its own, not requiring grad, on the same storage
    return lambda **tensors: call(**{name: _row_major(t.detach())
                                     for name, t in tensors.items()})


def _row_major(t):
    """t where its strides are its shape's row-major ones, else a row-major copy (also
    where only a size-1 dimension's stride differs, which is_contiguous() ignores and
    dynamo's guards do not). Contiguous tensors without size-1 dimensions, the usual
    case, are passed on after one check."""
    if t.is_contiguous() and 1 not in t.shape:
        return t
    stride, strides = 1, []
    for size in reversed(t.shape):
        strides.append(stride)
        stride *= size
    if t.stride() == tuple(reversed(strides)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _with_own_code(fn):
    """A copy of function `fn` with a code object of its own (a functools.partial would
    not do: dynamo traces all partials through one wrapper)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, None,
                              fn.__closure__)


@functools.cache
def _compile(device, dtype, seq_len, embed_dim, num_heads, scale, norm_eps, ln_grad,
             batch_bucket, cuda_graph, input_names, products):
    """One compiled backward; the arguments are the cache key (input_names: the
    contract's inputs, or the module's: qkv for q, k, v, ln_bias for x_norm;
    products: block_backward's). device, with
    its index: dynamo guards on a tensor's device, so GPUs sharing one code object would
    each add graphs to it, and past its recompile limit (8) the fullgraph compile
    raises (five GPUs of one process at two graphs each)."""
    del seq_len, embed_dim, num_heads, input_names     # they key the cache only
    device_type = device.type
    constants = dict(scale=scale, norm_eps=norm_eps, ln_grad=ln_grad, products=products)

    # On the CPU a float32 graph computes in float64 (its casts inside the graph): there
    # torch's float32 matmul precision "medium" runs float32 matmuls in bf16 (oneDNN; a
    # contract call at 16 tokens x 32 then missed by 2e-3), and the CPU path exists to
    # be exact.
    in_float64 = products is Products.PLAIN and dtype == torch.float32

    def backward_graph(**tensors):
        if in_float64:
            doubles = {name: t.double() for name, t in tensors.items()}
            return tuple(g.float() for g in block_backward(**doubles, **constants))
        return block_backward(**tensors, **constants)
    return compile_graph(backward_graph, device_type, products.graph_tag, batch_bucket,
                         BATCHED_INPUTS, cuda_graph)


def batch_bucket(batch):
    """None for batch 1 (static graph), else the BATCH_BUCKETS entry holding `batch`."""
    if batch == 1:
        return None
    return next(b for b in BATCH_BUCKETS if b[0] <= batch <= b[1])


def products_for(device_type, products, rows, probabilities_given):
    """The products block_backward runs for a call's `products` (checked by the
    callers): plain ones off CUDA (Products.on_device), and with P given (the
    contract's inputs) bf16x3 past HIGH_PRECISION_MAX_ROWS rows is fp16x3."""
    if (products is Products.BF16X3 and probabilities_given
            and rows > HIGH_PRECISION_MAX_ROWS):
        products = Products.FP16X3
    return products.on_device(device_type)


@torch.compiler.disable
@out_of_memory_as_such
def compiled_backward(inputs, *, scale, norm_eps, ln_grad, products):
    """Run the compiled graph on a dict of validated tensors at `products` (a
    precision.Products, as products_for adjusts it). Opaque to an enclosing
    torch.compile (of a model using VisionAttentionBlock): our graph is compiled on its
    own, with its own options, and called from there. A device out-of-memory, in the
    compile or the run, raises torch.OutOfMemoryError (errors.py)."""
    x = inputs["x"]
    B, S, E = x.shape
    recompute_p = check_probs_or_lse("compiled_backward", inputs.get("probs"),
                                     inputs.get("lse"))
    num_heads = inputs["lse" if recompute_p else "probs"].shape[1]
    fn = _compile(x.device, x.dtype, S, E, num_heads, scale, norm_eps, ln_grad,
                  batch_bucket(B), uses_cuda_graph(x.device.type, B), tuple(inputs),
                  products_for(x.device.type, products, B * S, not recompute_p))
    return fn(**inputs)
