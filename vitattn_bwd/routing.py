"""Which computation `vision_attention` runs for a call: the stock ops or the fused path,
and on the fused path which products (precision.Products), in which dtypes, and as what
kind of call.

`route(...)` is a pure function of the call's facts (device, dtypes, autocast, the
explicit `precision` and torch's own, whether torch.compile is tracing, and where the
one-product path runs); `vision_attention` gathers the facts and follows the decision.
With precision None:

- inside an autocast region, or for a block all in bfloat16 or all in float16: the stock
  ops (`stock_forward`); `precision="medium"` asks for the one-product path there;
- otherwise the fused path at torch's float32 matmul precision, on a GPU only at head
  dims the attention kernels take (softmax_bwd.triton_supports), and not inside
  torch.compile at "high" for training steps of at most COMPILED_FLOAT32_STOCK_MAX_BATCH
  images (the stock ops, which the user's compile fuses). "highest" and the
  deterministic flag (without warn_only) keep the fused path: the stock ops are neither
  float32-faithful nor deterministic there.

The stock route runs its attention as deterministic_sdpa's (cuDNN's forward, our
warp-specialized backward) under torch.use_deterministic_algorithms(True), and without
the flag in bf16 training steps of at least OUR_ATTENTION_MIN_BATCH images. Inside
torch.compile the fused path runs as block_ops.py's torch.library operators, opaque to
dynamo, instead of the autograd.Function of eager calls. The measurements behind each
default: docs/performance.md, "Towers" and "Ruled out".
"""
from typing import NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import softmax_bwd, softmax_bwd_gluon
from .precision import HALF_DTYPES, Products, fused_products


class Route(NamedTuple):
    """The decision for one call.

    stock: run `stock_forward` (torch's own LayerNorm, Linear and SDPA, in the caller's
      autocast region or the tensors' dtype); the other fields but
      deterministic_attention are then None / False.
    deterministic_attention: with stock, the attention as deterministic_sdpa's
      instead of SDPA (under torch.use_deterministic_algorithms(True)).
    products: the fused path's precision.Products (VisionAttentionFunction's), decided
      here once for the forward and the backward.
    compute_dtype: the dtype the fused path's tensors are cast to.
    opaque_ops: run the fused path as the torch.library operators (under torch.compile)
      rather than the autograd.Function."""
    stock: bool
    products: Products | None = None
    compute_dtype: torch.dtype | None = None
    opaque_ops: bool = False
    deterministic_attention: bool = False


STOCK = Route(stock=True)
STOCK_DETERMINISTIC_ATTENTION = Route(stock=True, deterministic_attention=True)

# Without the deterministic flag, the stock route's attention runs as deterministic_sdpa's
# operators in training steps of at least this many images in these dtypes: from 24 the
# steps are GPU-bound and our backward beats SDPA's, below it the host time loses
# (docs/performance.md, "Towers", the autocast table, and "Ruled out").
OUR_ATTENTION_MIN_BATCH = 24
OUR_ATTENTION_DTYPES = (torch.bfloat16,)

# float32 at torch's "high" inside torch.compile: training steps of at most this many
# images run the stock ops, which the user's compile fuses; our operators left such steps
# host-bound (docs/performance.md, "Towers", the float32 table, and "Ruled out").
COMPILED_FLOAT32_STOCK_MAX_BATCH = 2


def one_product_supported(device, dtype, head_dim):
    """Where the one-product path (bf16 / fp16 activations, the attention core's
    one-product kernels) runs: on Hopper GPUs with Gluon (softmax_bwd_gluon.available), and on
    the CPU (the same graph with PyTorch math, for correctness). Elsewhere precision
    "medium" runs the fused float32 path at "high" instead (route). torch.compile reads
    its device and dtype part once (softmax_bwd_gluon.available)."""
    return device.type == "cpu" or softmax_bwd_gluon.available(device, dtype, head_dim)


def torch_float32_precision():
    """PyTorch's float32 matmul precision, "highest", "high" or "medium", from whichever
    setting the process used: the legacy one (torch.set_float32_matmul_precision) or the
    per-backend one (torch.backends.cuda.matmul.fp32_precision = "tf32" or "ieee"), where
    torch.get_float32_matmul_precision() raises once the two are mixed."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        cuda_precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
        return {"tf32": "high", "bf16": "medium"}.get(cuda_precision, "highest")


# Under torch.compile: the same, read once when the graph is traced (dynamo cannot put
# a function returning a string in a graph). Dynamo's global-state guard covers TF32
# (torch.backends.cuda.matmul.allow_tf32), so a change between "highest" and the other
# two recompiles; one between "high" and "medium" does not.
_traced_float32_precision = torch.compiler.assume_constant_result(torch_float32_precision)


@torch.compiler.assume_constant_result
def deterministic_warn_only():
    """torch.is_deterministic_algorithms_warn_only_enabled(), which dynamo cannot put in
    a graph: under torch.compile read once when the graph is traced (dynamo's guards
    cover the deterministic flag itself, not its warn_only)."""
    return torch.is_deterministic_algorithms_warn_only_enabled()


def float32_precision_now(compiling):
    """torch_float32_precision(), at each eager call, or once per traced graph where
    `compiling` (torch.compiler.is_compiling())."""
    return _traced_float32_precision() if compiling else torch_float32_precision()


def fused_kernels_for(device, head_dim):
    """Whether the fused float32 path's attention core runs kernels here: the Triton
    templates on CUDA at their head dims (multiples of 8 up to 128); the CPU's plain
    math counts (the CPU path exists for correctness, and is what the CPU tests
    check)."""
    return device.type == "cpu" or softmax_bwd.triton_supports(device.type,
                                                                torch.float32, head_dim)


def torch_func_transform_active(compiling):
    """Whether a torch.func transform (grad, vmap, jvp, ...) runs this call: the top of
    functorch's interpreter stack (torch's private API, stable since torch 2.0). Not
    read while torch.compile traces (dynamo then runs the transforms itself; the read
    would break the graph)."""
    return not compiling and torch._C._functorch.peek_interpreter_stack() is not None


def route(*, device_type, dtypes, x_dtype, autocast_dtype, precision, float32_precision,
          compiling, one_product, fused_kernels=True, deterministic=False,
          backward_batch=None, deterministic_attention=lambda dtype: False,
          torch_func=False):
    """The Route for a call (module docstring).

    device_type: "cpu" or "cuda"; dtypes: the set of the dtypes of x and every
    parameter; x_dtype: x's; autocast_dtype: the autocast dtype of an enabled autocast
    region on that device, else None; precision: the call's (None, "highest", "high",
    "medium"; checked by the caller); float32_precision: torch's float32 matmul
    precision (read for precision None only); compiling: torch.compiler.is_compiling();
    one_product(dtype) -> bool: whether the one-product path runs in that half dtype
    for this device and head dim (one_product_supported); fused_kernels: whether the
    fused float32 path's attention core has kernels for this device and head dim
    (fused_kernels_for); deterministic: whether a deterministic backward is asked for
    (torch.use_deterministic_algorithms(True) without warn_only, with gradients to
    compute: otherwise SDPA's faster kernels stay); backward_batch: the batch size where
    gradients are to be computed, else None; deterministic_attention(dtype) ->
    bool: whether deterministic_sdpa's attention runs for this call's activations in
    that half dtype (deterministic_sdpa.supported and .fits, and a non-empty batch); torch_func:
    whether a torch.func transform runs the call (torch_func_transform_active): then the
    stock ops, at any precision, since they are the only computation here with
    functorch rules (our autograd.Function and operators have none; torch.func.grad
    and vmap of the stock block work). TypeError for float64 on a device other than
    the CPU (the fused backward is float32 there)."""
    if torch_func:
        return STOCK
    native_half = len(dtypes) == 1 and x_dtype in HALF_DTYPES
    if precision is None:
        if autocast_dtype is not None or native_half or not fused_kernels:
            half = autocast_dtype if autocast_dtype is not None else (
                x_dtype if native_half else None)
            if half not in HALF_DTYPES or torch.float64 in dtypes:
                return STOCK
            if deterministic and deterministic_attention(half):
                return STOCK_DETERMINISTIC_ATTENTION
            # the batch is compared last, once the operators run here at all: under
            # torch.compile each comparison of a dynamic batch is a guard to recompile on
            if (half in OUR_ATTENTION_DTYPES and backward_batch is not None
                    and deterministic_attention(half)
                    and backward_batch >= OUR_ATTENTION_MIN_BATCH):
                return STOCK_DETERMINISTIC_ATTENTION
            return STOCK
        precision = float32_precision
        # compared last, as the batch above, and only where the batch is static: a
        # dynamic batch (at least 2 to dynamo) compared with 2 would be pinned to 2, an
        # error where the caller marked it dynamic
        if (compiling and device_type == "cuda" and precision == "high"
                and dtypes == {torch.float32} and not deterministic
                and backward_batch is not None
                and statically_known_true(backward_batch <= COMPILED_FLOAT32_STOCK_MAX_BATCH)):
            return STOCK
    half_dtype = None
    if precision == "medium":
        # one product per matmul where it runs: natively in the dtype of a bf16 / fp16
        # block, in the autocast dtype inside an autocast region, else bf16 on float32
        # math; elsewhere "high", which is more precise than "medium" asks
        if native_half and one_product(x_dtype):
            half_dtype = x_dtype
        elif torch.float64 not in dtypes:
            half = autocast_dtype if autocast_dtype in HALF_DTYPES else torch.bfloat16
            half_dtype = half if one_product(half) else None
        precision = "high"
    if native_half and half_dtype == x_dtype:
        compute = x_dtype                               # a bf16 / fp16 block, as it is
    elif autocast_dtype is not None:
        compute = torch.float32                 # custom_fwd(cast_inputs=torch.float32)
    elif torch.float64 in dtypes:
        if device_type != "cpu":
            raise TypeError(f"float64 is not supported on {device_type} (the fused "
                            "backward is float32 there); use float32 or autocast")
        compute = torch.float64
    else:
        compute = torch.float32
    return Route(stock=False, products=fused_products(precision, half_dtype),
                 compute_dtype=compute, opaque_ops=compiling)
