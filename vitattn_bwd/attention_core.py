"""The attention core of the backward as two custom operators.

    softmax_bwd_rows(P, grad_attn, k, v, scale) -> grad_q [B,S,E], delta [B,H,S]
    softmax_bwd_cols(P, grad_attn, q, v, delta, scale) -> grad_kv [B,S,2E] (= [dK | dV])

P is [B,H,S,S]; grad_attn (the out-projection gradient) is [B,S,E] with heads merged;
q, k, v are [B,H,S,D]. The outputs come with heads merged, ready for the QKV projection.

Eagerly they run the Triton kernels on CUDA (after splitting grad_attn, q, k and v into
bf16 hi/lo pairs, which is what the kernels read) and the same two-pass math in PyTorch
on other devices. Under torch.compile on CUDA, vitattn_bwd.inductor lowers them to Triton
templates that max-autotune tunes; elsewhere Inductor calls the eager implementation.
"""
import torch

from .precision import split_bf16, tf32_matmuls
from .reference import merge_heads, split_heads

# Tiles of the eager CUDA launch (the compiled path autotunes its own): (BLOCK_M, BLOCK_N,
# num_stages). Pipelined bf16 hi/lo tiles of head_dim 128 need smaller blocks to fit the
# 227 KB of shared memory of an H100/H200.
EAGER_TILES = {16: (64, 64, 2), 32: (64, 64, 2), 64: (64, 64, 2), 128: (32, 32, 2)}
SUPPORTED_TRITON_HEAD_DIMS = tuple(EAGER_TILES)


def _rows_math(attn_weights, grad_attn, k, v, scale):
    num_heads = attn_weights.shape[1]
    grad_attn = split_heads(grad_attn, num_heads)                          # [B,H,S,D]
    p_grad_p = attn_weights * (grad_attn @ v.transpose(-1, -2))            # [B,H,S,S]
    delta = p_grad_p.sum(-1)                                               # [B,H,S]
    grad_q = (p_grad_p @ k - delta.unsqueeze(-1) * (attn_weights @ k)) * scale
    return merge_heads(grad_q), delta


def _cols_math(attn_weights, grad_attn, q, v, delta, scale):
    num_heads = attn_weights.shape[1]
    grad_attn = split_heads(grad_attn, num_heads)                          # [B,H,S,D]
    grad_v = attn_weights.transpose(-1, -2) @ grad_attn
    grad_s = attn_weights * (grad_attn @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    grad_k = (grad_s.transpose(-1, -2) @ q) * scale
    return torch.cat([merge_heads(grad_k), merge_heads(grad_v)], dim=-1)   # [B,S,2E]


def _split(t):
    """Contiguous bf16 (hi, lo) pair of a float32 tensor, as the kernels read it."""
    return split_bf16(t.contiguous())


def _tiles(head_dim, block_m, block_n):
    default_m, default_n, num_stages = EAGER_TILES.get(head_dim, (64, 64, 2))
    return block_m or default_m, block_n or default_n, num_stages


def launch_rows(attn_weights, grad_attn, k, v, scale, block_m=None, block_n=None):
    """Run the rows kernel on any tensors Triton can reach (CUDA, or CPU when
    TRITON_INTERPRET=1)."""
    from .kernels.softmax_bwd import softmax_bwd_rows_kernel
    B, H, S, D = k.shape
    block_m, block_n, num_stages = _tiles(D, block_m, block_n)
    grad_q = torch.empty(B, S, H * D, device=k.device, dtype=torch.float32)
    delta = torch.empty(B, H, S, device=k.device, dtype=torch.float32)
    grid = (-(-S // block_m), B * H)
    softmax_bwd_rows_kernel[grid](attn_weights.contiguous(), *_split(grad_attn),
                                  *_split(k), *_split(v), grad_q, delta, scale,
                                  SEQ_LEN=S, NUM_HEADS=H, HEAD_DIM=D, BLOCK_M=block_m,
                                  BLOCK_N=block_n, num_stages=num_stages)
    return grad_q, delta


def launch_cols(attn_weights, grad_attn, q, v, delta, scale, block_m=None, block_n=None):
    """Run the cols kernel (see launch_rows)."""
    from .kernels.softmax_bwd import softmax_bwd_cols_kernel
    B, H, S, D = q.shape
    block_m, block_n, num_stages = _tiles(D, block_m, block_n)
    grad_kv = torch.empty(B, S, 2 * H * D, device=q.device, dtype=torch.float32)
    grid = (-(-S // block_n), B * H)
    softmax_bwd_cols_kernel[grid](attn_weights.contiguous(), *_split(grad_attn),
                                  *_split(q), *_split(v), delta.contiguous(),
                                  grad_kv, scale,
                                  SEQ_LEN=S, NUM_HEADS=H, HEAD_DIM=D, BLOCK_M=block_m,
                                  BLOCK_N=block_n, num_stages=num_stages)
    return grad_kv


def triton_supports(device_type, dtype, head_dim):
    """The Triton kernels (eager) and templates (compiled) take float32 CUDA tensors with
    a power-of-two head_dim >= 16; anything else runs the PyTorch math (correct, but it
    materializes S x S)."""
    return (device_type == "cuda" and dtype == torch.float32
            and head_dim in SUPPORTED_TRITON_HEAD_DIMS)


def _use_triton(t):
    return triton_supports(t.device.type, t.dtype, t.shape[-1])


@torch.library.custom_op("vitattn_bwd::softmax_bwd_rows", mutates_args=())
def softmax_bwd_rows(attn_weights: torch.Tensor, grad_attn: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(k):
        return launch_rows(attn_weights, grad_attn, k, v, scale)
    with tf32_matmuls(False):         # the compiled graph runs under TF32 on CUDA
        return _rows_math(attn_weights, grad_attn, k, v, scale)


@softmax_bwd_rows.register_fake
def _(attn_weights, grad_attn, k, v, scale):
    B, H, S, D = k.shape
    return k.new_empty(B, S, H * D), k.new_empty(B, H, S)


@torch.library.custom_op("vitattn_bwd::softmax_bwd_cols", mutates_args=())
def softmax_bwd_cols(attn_weights: torch.Tensor, grad_attn: torch.Tensor, q: torch.Tensor,
                     v: torch.Tensor, delta: torch.Tensor, scale: float) -> torch.Tensor:
    if _use_triton(q):
        return launch_cols(attn_weights, grad_attn, q, v, delta, scale)
    with tf32_matmuls(False):
        return _cols_math(attn_weights, grad_attn, q, v, delta, scale)


@softmax_bwd_cols.register_fake
def _(attn_weights, grad_attn, q, v, delta, scale):
    B, H, S, D = q.shape
    return q.new_empty(B, S, 2 * H * D)
