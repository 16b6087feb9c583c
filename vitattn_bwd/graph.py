"""The backward as explicit PyTorch math, compiled once per configuration by Inductor.

`block_backward` is the graph: cuBLAS-class GEMMs in float32-grade split precision
(precision.py) around the two attention-core operators (attention_core.py), with the
bias sums and the LayerNorm backward left to Inductor to fuse. On CUDA it is compiled in
max-autotune mode (CUDA graphs at batch 1 only, see compile_mode), where the attention
core becomes our Triton templates (inductor.py); on the CPU Inductor emits C++ and the
attention core runs its PyTorch math.

`compiled_backward` keeps one compiled graph per (device, dtype, seq_len, embed_dim,
num_heads, scale, norm_eps, ln_grad, batch bucket). Batch 1 gets a static graph (dynamo
specializes size-1 dimensions); batches 2-15 and 16 and up get one dynamic-batch graph
each (Inductor compiles a bucket once more when a size fails a guard of its first
compile: batch 10 after batch 2 on the H200). Max-autotune times its candidates at the
first batch size a graph sees, so the buckets keep small and large batches from sharing
one choice of tiles and GEMM kernels.
Exceeding dynamo's recompile limit raises instead of silently running eager code.
"""
import contextlib
import functools
import os
import threading
import types

import torch

from . import attention_core
from .cache import cache_key_tag
from .precision import matmul_fp32_grade, matmul_tf32, tf32_matmuls
from .reference import layer_norm_backward

# Compiled graphs one process may hold before dynamo raises (one per configuration key).
MAX_COMPILED_GRAPHS = 64
# Batch sizes >= 2 that share a dynamic-batch graph, each bucket its own torch.compile
# object: (smallest, largest).
BATCH_BUCKETS = ((2, 15), (16, float("inf")))

_CACHE_KEY_TAG = cache_key_tag()
BATCHED_INPUTS = ("grad_output", "x", "x_mean", "x_var", "x_norm", "q", "k", "v",
                  "attn_weights", "attn_output")


def block_backward(grad_output, x, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v,
                   attn_weights, attn_output, out_weight, *, scale, norm_eps, ln_grad):
    """The seven gradients; same math as reference.attention_block_backward."""
    B, S, E = x.shape
    rows = B * S
    grad_rows = grad_output.reshape(rows, E)                                   # [B*S,E]

    # out projection: y = attn_output @ out_weight.T + out_bias (+ x)
    grad_out_weight = matmul_fp32_grade(grad_rows.t(), attn_output.reshape(rows, E))  # [E,E]
    grad_out_bias = grad_rows.sum(0)
    grad_attn = matmul_fp32_grade(grad_rows, out_weight).view(B, S, E)         # [B,S,E]

    # attention core: two passes over P, no S x S intermediate
    grad_q, delta = attention_core.softmax_bwd_rows(attn_weights, grad_attn, k, v, scale)
    grad_kv = attention_core.softmax_bwd_cols(attn_weights, grad_attn, q, v, delta, scale)
    grad_qkv = torch.cat([grad_q, grad_kv], dim=-1).view(rows, 3 * E)         # [B*S,3E]

    # qkv projection: qkv = x_norm @ qkv_weight.T + qkv_bias
    grad_x_norm = matmul_fp32_grade(grad_qkv, qkv_weight).view(B, S, E)
    grad_qkv_weight = matmul_tf32(grad_qkv.t(), x_norm.reshape(rows, E))       # [3E,E]
    grad_qkv_bias = grad_qkv.sum(0)

    grad_x, grad_ln_weight, grad_ln_bias = layer_norm_backward(
        grad_output, grad_x_norm, x, x_mean, x_var, ln_weight, norm_eps, ln_grad)
    return (grad_x, grad_qkv_weight, grad_qkv_bias, grad_out_weight, grad_out_bias,
            grad_ln_weight, grad_ln_bias)


def compile_mode(device_type, bucket):
    """Inductor mode on CUDA: max-autotune. The static batch-1 graph also runs as a CUDA
    graph when called from the main thread: at batch 1 the GPU work (~0.26 ms) is smaller
    than the cost of launching its ~25 kernels one by one, and copying its inputs into the
    graph's static buffers is cheap. Not from other threads: CUDA graph trees keep
    per-thread state, and the autograd engine runs VisionAttentionBlock's backward on a
    thread of its own (one H200 run of scripts/bench_module.py ended without a message
    right after its batch-1 step there; not reproduced, so we do not go there). The
    dynamic-batch graphs run without CUDA graphs: those would be recorded again for every
    batch size and copy hundreds of MB of inputs per call.
    VITATTN_BWD_COMPILE_MODE overrides the mode for every graph (tests of odd shapes use
    "default": minutes less compiling; the attention-core templates still tune)."""
    if device_type != "cuda":
        return None
    cuda_graph = bucket is None and threading.current_thread() is threading.main_thread()
    default = "max-autotune" if cuda_graph else "max-autotune-no-cudagraphs"
    return os.environ.get("VITATTN_BWD_COMPILE_MODE", default)


def _uses_cuda_graphs(mode):
    return mode in ("max-autotune", "reduce-overhead")


@functools.cache
def _compile(device_type, dtype, seq_len, embed_dim, num_heads, scale, norm_eps, ln_grad,
             batch_bucket, mode):
    """One torch.compile'd graph; the arguments are the cache key."""
    del dtype, seq_len, embed_dim, num_heads                  # they key the cache only
    fn = functools.partial(_own_code_object(block_backward), scale=scale,
                           norm_eps=norm_eps, ln_grad=ln_grad)
    _register_templates(required=device_type == "cuda")
    return torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)


def _own_code_object(fn):
    """A copy of fn with a code object of its own. Dynamo keeps its compiled graphs per
    code object and reuses any whose guards pass: without the copy, the dynamic graph of
    one batch bucket would serve the other bucket too, tuned for the wrong sizes."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(copy, fn)


def _register_templates(required):
    """Import inductor.py, which registers the attention-core lowerings. It needs triton;
    on the CPU without triton, Inductor calls the eager operators instead, as the lowering
    itself would."""
    try:
        from . import inductor  # noqa: F401
    except ImportError:
        if required:
            raise


def batch_bucket(batch):
    """None for batch 1 (static graph), else the BATCH_BUCKETS entry holding `batch`."""
    if batch == 1:
        return None
    return next(b for b in BATCH_BUCKETS if b[0] <= batch <= b[1])


@contextlib.contextmanager
def compile_settings(device_type, bucket):
    """Settings every compile and call of our graphs runs under. The batch bucket is part
    of the FX graph cache's key: the buckets' graphs are alike but tuned differently."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._dynamo.config.patch(
            recompile_limit=MAX_COMPILED_GRAPHS,
            accumulated_recompile_limit=4 * MAX_COMPILED_GRAPHS,
            fail_on_recompile_limit_hit=True))
        smallest_batch = 1 if bucket is None else bucket[0]
        stack.enter_context(torch.compiler.config.patch(
            cache_key_tag=f"{_CACHE_KEY_TAG}-batch{smallest_batch}"))
        if device_type == "cuda":
            stack.enter_context(tf32_matmuls())
        yield


@torch.compiler.disable
def compiled_backward(inputs, *, scale, norm_eps, ln_grad):
    """Run the compiled graph on a dict of validated tensors. Opaque to an enclosing
    torch.compile (of a model using VisionAttentionBlock): our graph is compiled on its
    own, with its own settings, and called from there."""
    x = inputs["x"]
    B, S, E = x.shape
    num_heads = inputs["q"].shape[1]
    bucket = batch_bucket(B)
    mode = compile_mode(x.device.type, bucket)
    fn = _compile(x.device.type, x.dtype, S, E, num_heads, float(scale), float(norm_eps),
                  ln_grad, bucket, mode)
    if bucket is not None:
        for name in BATCHED_INPUTS:
            torch._dynamo.mark_dynamic(inputs[name], 0)
    with compile_settings(x.device.type, bucket):
        grads = fn(**inputs)
    if _uses_cuda_graphs(mode):
        # a CUDA graph's outputs live in its memory pool and the next replay overwrites
        # them: hand out copies (about 20 MB at batch 1)
        grads = tuple(g.clone() for g in grads)
    return grads
