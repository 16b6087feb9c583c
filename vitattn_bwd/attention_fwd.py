"""The attention forward as a custom operator that never writes an S x S tensor:

    attention_fwd(q, k, v, scale) -> attn_output [B,S,E], lse [B,H,S]
    attention_fwd_split(qkv_hi, qkv_lo, num_heads, scale) -> the same

q, k, v are [B,H,S,D] (any strides); attn_output = softmax(scale * q k^T) v with heads
merged (E = H*D, what the out projection reads); lse = logsumexp(scale * q k^T) per row
(natural log), from which the backward recomputes the probabilities:
P = exp(scale * q k^T - lse) (`attention_probabilities`).

On CUDA, for float32 and the head dims of the Triton kernels (multiples of 8 up to 128),
it runs the FlashAttention-style kernel of kernels/attention_fwd.py after splitting q, k
and v once into bf16 hi/lo pairs (what the kernel reads; float32-grade bf16x3 products,
~1e-5 relative error). `attention_fwd_split` takes that split made already, of a whole
QKV projection [B,S,3E] (q | k | v columns, heads side by side): VisionAttentionBlock's
compiled forward makes it in the kernel that makes qkv, where the op's own split would
cost three strided passes (it calls it only where the kernel applies; elsewhere this op
runs the math on hi + lo, about 1e-5 off float32). Elsewhere attention_fwd runs
`attention_math`: the same outputs from PyTorch ops in the inputs' dtype, materializing
S x S (float32 products as torch is set: no TF32 unless enabled).
"""
import math

import torch

from . import buffers
from .softmax_bwd import TileConfig, head_tile, triton_supports
from .layout import merge_heads, qkv_heads
from .precision import split_bf16_truncated


# Defaults per head tile (softmax_bwd.head_tile: head dims that are not powers of two
# run in the next power of two's tiles, zero-padded), sized for the 227 KB of shared
# memory of an H100/H200: a program keeps its q hi/lo tiles (2 * BLOCK_M * D * 2 bytes)
# and pipelines num_stages k and v hi/lo tiles (4 * BLOCK_N * D * 2 bytes each stage).
# D=64: 32 KB + 3 * 32 KB; D=128: 32 KB + 2 * 64 KB. scripts/time_kernels.py --kernel
# attention_fwd --sweep times alternatives.
FWD_TILES = {16: TileConfig(128, 64, 4, 3), 32: TileConfig(128, 64, 4, 3),
             64: TileConfig(128, 64, 8, 3), 128: TileConfig(64, 64, 4, 2)}


def _check_inputs(q, k, v, scale):
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must be [B,H,S,D] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("q, k, v must share dtype and device")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")


def attention_math(q, k, v, scale):
    """The operator's outputs from PyTorch ops in q's dtype (materializes S x S)."""
    B, H, S, D = q.shape
    logits = (q @ k.transpose(-1, -2)) * scale                             # [B,H,S,S]
    lse = torch.logsumexp(logits, dim=-1)                                  # [B,H,S]
    attn_output = torch.softmax(logits, dim=-1) @ v                        # [B,H,S,D]
    return attn_output.transpose(1, 2).reshape(B, S, H * D), lse           # [B,S,E]


def attention_probabilities(q, k, lse, scale):
    """P = exp(scale * q k^T - lse) [B,H,S,S]: the softmax, recomputed from the saved
    log-sum-exp as the backward does (PyTorch ops, for tests)."""
    return torch.exp((q @ k.transpose(-1, -2)) * scale - lse.unsqueeze(-1))


def split_for_kernel(t):
    """bf16 (hi, lo) of float32 t with one set of strides and a contiguous last dim, as
    the kernel reads them. Strided views (the module's heads of the QKV output) are
    split without a copy first."""
    hi, lo = split_bf16_truncated(t)
    if hi.stride() != lo.stride() or hi.stride(-1) != 1:
        hi, lo = split_bf16_truncated(t.contiguous())
    return hi, lo


def launch_attention_fwd(q, k, v, scale, tiles=None):
    """Run the Triton kernel on any tensors Triton can reach (CUDA, or CPU when
    TRITON_INTERPRET=1). `tiles`: a TileConfig, default FWD_TILES[head_dim]."""
    _check_inputs(q, k, v, scale)
    if q.numel() == 0:
        B, H, S, D = q.shape
        return q.new_empty(B, S, H * D), q.new_empty(B, H, S)
    return launch_attention_fwd_presplit(*(split_for_kernel(t) for t in (q, k, v)), scale,
                                         tiles)


def launch_attention_fwd_presplit(q_halves, k_halves, v_halves, scale, tiles=None):
    """The kernel on q, k, v already split: each a (hi, lo) pair of bf16 [B,H,S,D]
    tensors, hi and lo with the same strides and a contiguous last dim (what
    split_for_kernel makes). Returns attn_output [B,S,E] and lse [B,H,S], float32."""
    from .kernels.attention_fwd import attention_fwd_kernel
    (q_hi, q_lo), (k_hi, k_lo), (v_hi, v_lo) = q_halves, k_halves, v_halves
    B, H, S, D = q_hi.shape
    tiles = tiles or FWD_TILES[head_tile(D)]
    attn_output = buffers.output_buffer(q_hi, B, S, H * D, dtype=torch.float32)
    lse = buffers.output_buffer(q_hi, B, H, S, dtype=torch.float32)
    grid = (-(-S // tiles.block_m) * B * H,)              # kernels.program_block
    attention_fwd_kernel[grid](
        q_hi, q_lo, k_hi, k_lo, v_hi, v_lo, attn_output, lse, *q_hi.stride()[:3],
        *k_hi.stride()[:3], *v_hi.stride()[:3], scale, SEQ_LEN=S, NUM_HEADS=H, HEAD_DIM=D,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return attn_output, lse


@torch.library.custom_op("vitattn_bwd::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v, scale)
    # the kernel on CUDA only: on the CPU the math is the fast path, interpreter or not
    if q.device.type == "cuda" and triton_supports("cuda", q.dtype, q.shape[-1]):
        return launch_attention_fwd(q, k, v, scale)
    return attention_math(q, k, v, scale)


@attention_fwd.register_fake
def _(q, k, v, scale):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H * D), q.new_empty(B, H, S)


def attention_fwd_half(q, k, v, scale):
    """attn_output [B,S,E] in q's dtype and lse [B,H,S] float32 for bf16 / fp16 q, k, v
    [B,H,S,D] (any strides with a contiguous last dim): torch's own flash-attention
    forward, the kernel F.scaled_dot_product_attention runs on such inputs (CUDA: FA2;
    the CPU: its flash kernel), which also returns the log-sum-exp the backward
    recomputes P from (natural log)."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v,
                                                                      scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, scale=scale)
    return merge_heads(out), lse                                # [B,S,E], [B,H,S]


def cudnn_forward_runs(device):
    """Whether attention_fwd_cudnn can run on `device`: CUDA with cuDNN 9 or later (its
    attention operator's first version), neither cuDNN (torch.backends.cudnn.enabled)
    nor its SDPA backend (torch.backends.cuda.enable_cudnn_sdp(False)) turned off by
    the user."""
    return (device.type == "cuda" and torch.backends.cudnn.is_available()
            and torch.backends.cudnn.enabled and torch.backends.cudnn.version() >= 90000
            and torch.backends.cuda.cudnn_sdp_enabled())


def attention_fwd_cudnn(q, k, v, scale):
    """attention_fwd_half's outputs from torch's cuDNN attention forward (where
    cudnn_forward_runs): on the H200 at batch 32 0.155 ms against flash's 0.210, its
    log-sum-exp within 9.5e-7 of flash's (`scripts/time_kernels.py --kernel core_ws`).
    Unlike cuDNN's backward (dQ added by atomics) it is deterministic."""
    batch, heads, seq_len, _ = q.shape
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, scale=scale)[:2]                  # lse [B,H,S,1]
    return merge_heads(out), lse.reshape(batch, heads, seq_len)  # [B,S,E], [B,H,S]


# attention_fwd_split is defined through torch.library.Library, not custom_op, as the
# backward's Gluon operators are: the module's compiled forward calls it on every step,
# and under cProfile on the H200 custom_op's wrapper (its aliasing check) took 0.3 ms
# per call (the block's host time without cProfile moved less than the machines' spread).
_LIBRARY = torch.library.Library("vitattn_bwd", "FRAGMENT")
_LIBRARY.define("attention_fwd_split(Tensor qkv_hi, Tensor qkv_lo, int num_heads, "
                "float scale) -> (Tensor, Tensor)")


def _attention_fwd_split(qkv_hi, qkv_lo, num_heads, scale):
    qkv_hi, qkv_lo = qkv_hi.contiguous(), qkv_lo.contiguous()
    heads = [qkv_heads(part, num_heads) for part in (qkv_hi, qkv_lo)]      # [B,H,S,D]
    if qkv_hi.device.type == "cuda" and triton_supports("cuda", torch.float32,
                                                         heads[0][0].shape[-1]):
        return launch_attention_fwd_presplit(*zip(*heads), scale)
    q, k, v = (hi.float() + lo.float() for hi, lo in zip(*heads))
    return attention_fwd(q, k, v, scale)


_LIBRARY.impl("attention_fwd_split", _attention_fwd_split, "CompositeExplicitAutograd")


@torch.library.register_fake("vitattn_bwd::attention_fwd_split", lib=_LIBRARY)
def _(qkv_hi, qkv_lo, num_heads, scale):
    B, S, E = qkv_hi.shape[0], qkv_hi.shape[1], qkv_hi.shape[2] // 3
    return qkv_hi.new_empty(B, S, E, dtype=torch.float32), qkv_hi.new_empty(
        B, num_heads, S, dtype=torch.float32)


# attention_fwd_split(qkv_hi, qkv_lo, num_heads, scale) -> attn_output [B,S,E], lse
# [B,H,S]: attention_fwd of the q, k, v of a QKV projection [B,S,3E] given as its bf16
# (hi, lo) parts (precision.split_bf16_truncated).
attention_fwd_split = torch.ops.vitattn_bwd.attention_fwd_split
