"""Self-attention for the stock route under torch.use_deterministic_algorithms(True), and
in bf16 training steps from routing.OUR_ATTENTION_MIN_BATCH images without it: torch's
cuDNN attention forward (flash's where cuDNN's is not there) with the warp-specialized
Gluon backward (attention_bwd_ws.py), as two torch.library operators:

    torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, num_heads)
        -> attn [B,S,E] (SDPA of qkv's q, k, v, merged heads), lse [B,H,S] float32
    torch.ops.vitattn_bwd.sdpa_ws_bwd(grad_attn, qkv, attn, lse, num_heads)
        -> grad_qkv [B,S,3E]

qkv [B,S,3E] is a QKV projection's output in bf16 or fp16 (q | k | v columns), as the
stock block's F.linear gives it under autocast; the scale is SDPA's default. The
forward's autograd formula is the backward operator, so that inside a user's
torch.compile both are opaque operators; eager calls run the same two implementations
through a plain torch.autograd.Function (`attention`), whose host time is lower.

Why: the flag takes SDPA's backward off cuDNN (whose dQ adds race) onto a slower
deterministic one; the warp-specialized backward is deterministic by construction (dQ
added in a fixed order) and faster than SDPA's cuDNN backward even without the flag
(docs/performance.md, "The one-product core"). It runs where it was tested: Hopper, head
dim 64 (`supported`), and where its launcher takes the shapes (`fits`).
"""
import math

import torch

from . import attention_bwd_ws
from .attention_fwd import attention_fwd_cudnn, attention_fwd_half, cudnn_forward_runs
from .layout import qkv_heads
from .precision import HALF_DTYPES

# The one head dim the warp-specialized kernel takes (its tests and timings cover it).
HEAD_DIMS = (attention_bwd_ws.HEAD_DIM,)

_LIBRARY = torch.library.Library("vitattn_bwd", "FRAGMENT")
_LIBRARY.define("sdpa_ws_fwd(Tensor qkv, int num_heads) -> (Tensor, Tensor)")
_LIBRARY.define("sdpa_ws_bwd(Tensor grad_attn, Tensor qkv, Tensor attn, Tensor lse, "
                "int num_heads) -> Tensor")


def supported(device, dtype, head_dim):
    """Whether the operators run for `dtype` activations at `head_dim` on `device`:
    Hopper GPUs whose triton compiles the warp-specialized kernel
    (attention_bwd_ws.compile_failure), bf16 or fp16, head dims in HEAD_DIMS. The head
    dim is compared outside `_runs_on`: under torch.compile(dynamic=True) it is symbolic,
    which torch 2.11 cannot pass to a constant-result function."""
    return _runs_on(device, dtype) and head_dim in HEAD_DIMS


@torch.compiler.assume_constant_result
def _runs_on(device, dtype):
    """supported's device and dtype part: constant for a process, so torch.compile reads
    it once when tracing."""
    return (device.type == "cuda" and dtype in HALF_DTYPES
            and torch.cuda.get_device_capability(device)[0] == 9
            and attention_bwd_ws.compile_failure() is None)


@torch.compiler.assume_constant_result
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def fits(batch, num_heads, seq_len, device):
    """Whether the backward operator takes these shapes on `device` (where `supported`):
    attention_bwd_ws.fits at its launch configuration (up to 16,896 tokens on an H200;
    longer sequences keep SDPA, rather than fail in the backward)."""
    return attention_bwd_ws.fits(batch, num_heads, seq_len, _sm_count(device))


def sdpa_ws_fwd(qkv, num_heads):
    q, k, v = qkv_heads(qkv, num_heads)
    forward = attention_fwd_cudnn if cudnn_forward_runs(qkv.device) else attention_fwd_half
    attn, lse = forward(q, k, v, 1.0 / math.sqrt(q.shape[-1]))
    return attn.contiguous(), lse.contiguous()                        # [B,S,E], [B,H,S]


def sdpa_ws_bwd(grad_attn, qkv, attn, lse, num_heads):
    q, k, v = qkv_heads(qkv, num_heads)
    # triton launches on the current device: make it qkv's (an operator gets no device
    # guard from the dispatcher; Inductor's graphs set one, eager calls do not)
    with torch.cuda.device(qkv.device):
        return attention_bwd_ws.launch(                                # [B,S,3E]
            q, k, v, grad_attn.contiguous(), attn, lse, 1.0 / math.sqrt(q.shape[-1]),
            attention_bwd_ws.FASTEST_TILES)


_LIBRARY.impl("sdpa_ws_fwd", sdpa_ws_fwd, "CUDA")
_LIBRARY.impl("sdpa_ws_bwd", sdpa_ws_bwd, "CUDA")


@torch.library.register_fake("vitattn_bwd::sdpa_ws_fwd", lib=_LIBRARY)
def _(qkv, num_heads):
    batch, seq_len, width = qkv.shape
    return (qkv.new_empty(batch, seq_len, width // 3),
            qkv.new_empty(batch, num_heads, seq_len, dtype=torch.float32))


@torch.library.register_fake("vitattn_bwd::sdpa_ws_bwd", lib=_LIBRARY)
def _(grad_attn, qkv, attn, lse, num_heads):
    return qkv.new_empty(qkv.shape)


def _setup_context(ctx, inputs, output):
    qkv, ctx.num_heads = inputs
    attn, lse = output
    ctx.save_for_backward(qkv, attn, lse)
    ctx.mark_non_differentiable(lse)


DOUBLE_BACKWARD_MESSAGE = (
    "the deterministic attention (vitattn_bwd.deterministic_sdpa) does not support "
    "double backward (create_graph=True, which torch.func.grad uses too): its backward "
    "is a fused kernel without a graph of its own, as torch's flash-attention backward "
    "is")


def _saved_tensors(ctx):
    """qkv, attn, lse as the forward saved them, for a backward run without grad mode."""
    if torch.is_grad_enabled():          # create_graph=True: no second derivative here
        raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)
    return ctx.saved_tensors


def _backward(ctx, grad_attn, _):
    qkv, attn, lse = _saved_tensors(ctx)
    return torch.ops.vitattn_bwd.sdpa_ws_bwd(grad_attn, qkv, attn, lse, ctx.num_heads), None


torch.library.register_autograd("vitattn_bwd::sdpa_ws_fwd", _backward,
                                setup_context=_setup_context, lib=_LIBRARY)


class DeterministicAttentionFunction(torch.autograd.Function):
    """The operators' implementations for eager calls, without the dispatcher: the same
    forward and backward kernels, the same saved tensors and refusal of double
    backward. A backward traced by compiled autograd calls the backward operator, so
    that dynamo sees an opaque operator, not the launcher's Python."""

    @staticmethod
    def forward(qkv, num_heads):
        return sdpa_ws_fwd(qkv, num_heads)                            # [B,S,E], [B,H,S]

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)         # no zeros made for lse's gradient

    @staticmethod
    def backward(ctx, grad_attn, _):
        qkv, attn, lse = _saved_tensors(ctx)
        backward = (torch.ops.vitattn_bwd.sdpa_ws_bwd if torch.compiler.is_compiling()
                    else sdpa_ws_bwd)
        return backward(grad_attn, qkv, attn, lse, ctx.num_heads), None


def attention(qkv, num_heads):
    """attn [B,S,E]: SDPA of qkv [B,S,3E]'s heads, with the deterministic
    warp-specialized backward (module docstring): the operators inside torch.compile,
    the autograd.Function in eager calls."""
    if torch.compiler.is_compiling():
        return torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, num_heads)[0]
    return DeterministicAttentionFunction.apply(qkv, num_heads)[0]
