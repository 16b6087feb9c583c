"""Host side of the Gluon attention core (kernels/softmax_bwd_gluon.py): where it runs,
its launch configurations, and launchers that write into given output buffers.

The launchers take what the Inductor templates take (inductor.py): P or its log-sum-exp,
grad_attn, q, k and v as bf16 (hi, lo) pairs, the forward's output with the log-sum-exp
(else any placeholder), and the output buffers, which they fill:

    launch_rows(probs, *halves, attn_output, delta, grad_q_halves, grad_q16, scale, tiles)
        -> delta [B,H,S] float32, grad_q_halves [B,S,2E] bf16, grad_q16 [B,S,E] fp16
    launch_cols(probs, *halves, delta, grad_kv_halves, grad_kv16, scale, tiles)
        -> grad_kv_halves [B,S,4E] bf16, grad_kv16 [B,S,2E] fp16

`halves` is (grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo): grad_attn
[B,S,E] with heads merged, q, k, v [B,H,S,D], all contiguous. max-autotune weighs these
kernels against the Triton templates (inductor.py) on the GPUs where `available` says
they run.
"""
import functools

import torch

from .attention_core import TileConfig

# Launch configurations max-autotune times (block_m queries x block_n keys per tile;
# num_warps = 4 per 64 rows the program owns). Each compiles for sm_90 without spills
# (tests/test_kernel_resources.py).
ROWS_TILES = (TileConfig(64, 32, 4, 2), TileConfig(64, 64, 4, 2))
COLS_TILES = (TileConfig(64, 64, 4, 2), TileConfig(32, 64, 4, 3))
HEAD_DIMS = (64,)


@functools.cache
def _gluon_importable():
    try:
        from .kernels import softmax_bwd_gluon  # noqa: F401
    except ImportError:
        return False
    return True


def available(device, dtype, head_dim):
    """The Gluon kernels run on Hopper (compute capability 9.x) CUDA devices, for float32
    inputs and the head dims in HEAD_DIMS, with a Triton that has Gluon."""
    if device.type != "cuda" or dtype != torch.float32 or head_dim not in HEAD_DIMS:
        return False
    return torch.cuda.get_device_capability(device)[0] == 9 and _gluon_importable()


@functools.cache
def _operand_smem_layout(head_dim):
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for([64, head_dim], gl.bfloat16)


def _constexprs(probs, q, tiles, products):
    _, num_heads, seq_len, head_dim = q.shape
    return dict(SEQ_LEN=seq_len, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, NUM_STAGES=tiles.num_stages,
                RECOMPUTE_P=probs.dim() == 3, PRODUCTS=products,
                OPERAND_SMEM=_operand_smem_layout(head_dim), num_warps=tiles.num_warps)


def launch_rows(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                attn_output, delta, grad_q_halves, grad_q16, scale, tiles, products=3):
    from .kernels.softmax_bwd_gluon import softmax_bwd_rows_kernel
    batch, num_heads, seq_len, _ = q_hi.shape
    grid = (-(-seq_len // tiles.block_m), batch * num_heads)
    softmax_bwd_rows_kernel[grid](probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo,
                                  v_hi, v_lo, attn_output, grad_q16, grad_q_halves, delta,
                                  scale, **_constexprs(probs, q_hi, tiles, products))


def launch_cols(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                delta, grad_kv_halves, grad_kv16, scale, tiles, products=3):
    from .kernels.softmax_bwd_gluon import softmax_bwd_cols_kernel
    batch, num_heads, seq_len, _ = q_hi.shape
    grid = (-(-seq_len // tiles.block_n), batch * num_heads)
    softmax_bwd_cols_kernel[grid](probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo,
                                  v_hi, v_lo, delta, grad_kv16, grad_kv_halves, scale,
                                  **_constexprs(probs, q_hi, tiles, products))


# ---- what the compiled graph calls when max-autotune picks a Gluon kernel ------------
# The benchmark callables fill given buffers (the inputs and `out` of an Inductor
# extern choice); the operators return new tensors, so that Inductor sees every output
# of the kernel as an output of the node it schedules (inductor.py).

def rows_out(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
             attn_output, delta, grad_q_halves, *, out, scale, block_m, block_n, num_warps,
             num_stages):
    launch_rows(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                attn_output, delta, grad_q_halves, out, scale,
                TileConfig(block_m, block_n, num_warps, num_stages))


def cols_out(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo, delta,
             grad_kv_halves, *, out, scale, block_m, block_n, num_warps, num_stages):
    launch_cols(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                delta, grad_kv_halves, out, scale,
                TileConfig(block_m, block_n, num_warps, num_stages))


def _rows_outputs(q_hi):
    batch, num_heads, seq_len, head_dim = q_hi.shape
    embed_dim = num_heads * head_dim
    return (q_hi.new_empty(batch, seq_len, embed_dim, dtype=torch.float16),
            q_hi.new_empty(batch, seq_len, 2 * embed_dim, dtype=torch.bfloat16),
            q_hi.new_empty(batch, num_heads, seq_len, dtype=torch.float32))


def _cols_outputs(q_hi):
    batch, num_heads, seq_len, head_dim = q_hi.shape
    embed_dim = num_heads * head_dim
    return (q_hi.new_empty(batch, seq_len, 2 * embed_dim, dtype=torch.float16),
            q_hi.new_empty(batch, seq_len, 4 * embed_dim, dtype=torch.bfloat16))


@torch.library.custom_op("vitattn_bwd::gluon_softmax_bwd_rows", mutates_args=(),
                         device_types="cuda")
def gluon_softmax_bwd_rows(probs: torch.Tensor, grad_attn_hi: torch.Tensor,
                           grad_attn_lo: torch.Tensor, q_hi: torch.Tensor, q_lo: torch.Tensor,
                           k_hi: torch.Tensor, k_lo: torch.Tensor, v_hi: torch.Tensor,
                           v_lo: torch.Tensor, attn_output: torch.Tensor, scale: float,
                           block_m: int, block_n: int, num_warps: int, num_stages: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows pass on pre-split operands -> grad_q16, grad_q_halves, delta."""
    grad_q16, grad_q_halves, delta = _rows_outputs(q_hi)
    launch_rows(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                attn_output, delta, grad_q_halves, grad_q16, scale,
                TileConfig(block_m, block_n, num_warps, num_stages))
    return grad_q16, grad_q_halves, delta


@gluon_softmax_bwd_rows.register_fake
def _(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo, attn_output,
      scale, block_m, block_n, num_warps, num_stages):
    return _rows_outputs(q_hi)


@torch.library.custom_op("vitattn_bwd::gluon_softmax_bwd_cols", mutates_args=(),
                         device_types="cuda")
def gluon_softmax_bwd_cols(probs: torch.Tensor, grad_attn_hi: torch.Tensor,
                           grad_attn_lo: torch.Tensor, q_hi: torch.Tensor, q_lo: torch.Tensor,
                           k_hi: torch.Tensor, k_lo: torch.Tensor, v_hi: torch.Tensor,
                           v_lo: torch.Tensor, delta: torch.Tensor, scale: float,
                           block_m: int, block_n: int, num_warps: int, num_stages: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cols pass on pre-split operands -> grad_kv16, grad_kv_halves."""
    grad_kv16, grad_kv_halves = _cols_outputs(q_hi)
    launch_cols(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo,
                delta, grad_kv_halves, grad_kv16, scale,
                TileConfig(block_m, block_n, num_warps, num_stages))
    return grad_kv16, grad_kv_halves


@gluon_softmax_bwd_cols.register_fake
def _(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo, delta, scale,
      block_m, block_n, num_warps, num_stages):
    return _cols_outputs(q_hi)
