"""Everything that touches Inductor's private API: the attention-core Triton templates,
and their lowerings (so max-autotune weighs their configs). Inductor's FX graph cache does
not hash this file: cache.cache_key_tag() does, and every compile runs under that tag.

Checked against torch 2.11 (the GPU machine) and 2.13 (CPU development). Differences
between versions are handled here and nowhere else:
  - autotune_select_algorithm returns a node in 2.11 and (node, choice) from 2.12 on.

The templates reuse the device code of kernels/softmax_bwd.py verbatim: each template is
a thin entry point (program ids, output store) followed by the source of the `*_tile`
functions, so the kernels tested under TRITON_INTERPRET=1 are the kernels compiled here.
The lowerings hand the templates grad_attn, q, k and v as bf16 (hi, lo) pairs, made by
one pointwise pass each (shared by the two passes) from the float32 tensors of the graph.
"""
import inspect
import weakref

import torch
from torch._inductor import ir
from torch._inductor.lowering import empty_strided, fallback_handler, register_lowering
from torch._inductor.select_algorithm import (SymbolicGridFn, TritonTemplate,
                                              autotune_select_algorithm)
from torch._inductor.virtualized import V, ops

from . import attention_core
from .kernels import softmax_bwd

# (BLOCK_M, BLOCK_N, num_warps, num_stages) that max-autotune times against each other.
# The five measured best on the H200 (3.62 ms mean; docs/performance.md, v2). A wider set
# of nine measured worse (3.84 ms, v3): the dynamic graph tunes at the first batch size it
# sees, and more configs fit that size better and the large batches worse.
TILE_CONFIGS = (
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 32, 4, 3),
    (32, 64, 4, 3),
    (128, 64, 8, 2),
)

_DEVICE_FUNCTIONS = (softmax_bwd.split_bf16, softmax_bwd.dot_bf16x3, softmax_bwd.load_pair,
                     softmax_bwd.head_rows, softmax_bwd.softmax_bwd_rows_tile,
                     softmax_bwd.softmax_bwd_cols_tile, softmax_bwd.join_kv,
                     softmax_bwd.kv_columns)


def _device_source():
    """Source of the shared @triton.jit functions, protected from Jinja."""
    sources = [inspect.getsource(fn.fn) for fn in _DEVICE_FUNCTIONS]
    return "{% raw %}\n" + "\n\n".join(sources) + "{% endraw %}\n"


# Template constexprs: SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, SCALE.
_ROWS_ENTRY = r'''
{{def_kernel("P", "GRAD_ATTN_HI", "GRAD_ATTN_LO", "K_HI", "K_LO", "V_HI", "V_LO", "DELTA")}}
    batch = tl.program_id(1) // NUM_HEADS
    head = tl.program_id(1) % NUM_HEADS
    m_start = tl.program_id(0) * BLOCK_M
    grad_q, delta = softmax_bwd_rows_tile(P, GRAD_ATTN_HI, GRAD_ATTN_LO, K_HI, K_LO, V_HI,
                                          V_LO, batch, head, m_start, SCALE, SEQ_LEN,
                                          NUM_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    tl.store(DELTA + tl.program_id(1).to(tl.int64) * SEQ_LEN + offs_m, delta,
             mask=offs_m < SEQ_LEN)
    rows = offs_m[:, None]
    cols = head * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    mask = (rows < SEQ_LEN) & (cols < NUM_HEADS * HEAD_DIM)
    {{store_output(("batch", "rows", "cols"), "grad_q", "mask", val_shape=("BLOCK_M", "HEAD_DIM"))}}

'''

_COLS_ENTRY = r'''
{{def_kernel("P", "GRAD_ATTN_HI", "GRAD_ATTN_LO", "Q_HI", "Q_LO", "V_HI", "V_LO", "DELTA")}}
    batch = tl.program_id(1) // NUM_HEADS
    head = tl.program_id(1) % NUM_HEADS
    n_start = tl.program_id(0) * BLOCK_N
    grad_k, grad_v = softmax_bwd_cols_tile(P, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, V_HI,
                                           V_LO, DELTA, batch, head, n_start, SCALE,
                                           SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N)
    KV_WIDTH: tl.constexpr = 2 * HEAD_DIM
    grad_kv = join_kv(grad_k, grad_v, BLOCK_N, HEAD_DIM)
    rows = n_start + tl.arange(0, BLOCK_N)[:, None]
    cols = kv_columns(head, NUM_HEADS, HEAD_DIM)[None, :]
    mask = (rows < SEQ_LEN) & (cols < 2 * NUM_HEADS * HEAD_DIM)
    {{store_output(("batch", "rows", "cols"), "grad_kv", "mask", val_shape=("BLOCK_N", "KV_WIDTH"))}}

'''


@SymbolicGridFn
def _rows_grid(batch, num_heads, seq_len, meta, *, cdiv):
    return (cdiv(seq_len, meta["BLOCK_M"]), batch * num_heads, 1)


@SymbolicGridFn
def _cols_grid(batch, num_heads, seq_len, meta, *, cdiv):
    return (cdiv(seq_len, meta["BLOCK_N"]), batch * num_heads, 1)


ROWS_TEMPLATE = TritonTemplate(name="vitattn_softmax_bwd_rows", grid=_rows_grid,
                               source=_ROWS_ENTRY + _device_source())
COLS_TEMPLATE = TritonTemplate(name="vitattn_softmax_bwd_cols", grid=_cols_grid,
                               source=_COLS_ENTRY + _device_source())


def _node_of(selected):
    return selected[0] if isinstance(selected, tuple) else selected


def _tile_choices(template, input_nodes, layout, mutated_inputs, call_sizes, constexprs):
    choices = []
    for block_m, block_n, num_warps, num_stages in TILE_CONFIGS:
        template.maybe_append_choice(
            choices, input_nodes=input_nodes, layout=layout, mutated_inputs=mutated_inputs,
            call_sizes=call_sizes, num_warps=num_warps, num_stages=num_stages,
            BLOCK_M=block_m, BLOCK_N=block_n, **constexprs)
    if not choices:
        raise RuntimeError(f"{template.name}: no template config could be generated")
    return choices


def _template_applies(tensor_node, head_dim):
    return attention_core.triton_supports(tensor_node.get_device().type,
                                          tensor_node.get_dtype(), head_dim)


def _contiguous(node):
    return ir.ExternKernel.realize_input(ir.ExternKernel.require_contiguous(node))


# Per graph being lowered: id(float32 input node) -> (node, hi, lo). grad_attn and v feed
# both passes; they are split once.
_SPLITS = weakref.WeakKeyDictionary()


def _split_bf16(node):
    """Realized, contiguous bf16 (hi, lo) buffers of a float32 IR node: the math of
    precision.split_bf16 (hi truncated by an integer mask, so no cast can be folded
    away), emitted as pointwise IR that Inductor fuses into one kernel per input."""
    splits = _SPLITS.setdefault(V.graph, {})
    if id(node) in splits:
        return splits[id(node)][1:]
    load = node.make_loader()

    def hi_float32(index):
        bits = ops.to_dtype_bitcast(load(index), torch.int32, torch.float32)
        return ops.to_dtype_bitcast(ops.bitwise_and(bits, ops.constant(-65536, torch.int32)),
                                    torch.float32, torch.int32)

    def hi(index):
        return ops.to_dtype(hi_float32(index), torch.bfloat16)

    def lo(index):
        return ops.to_dtype(ops.sub(load(index), hi_float32(index)), torch.bfloat16)

    pair = tuple(_contiguous(ir.Pointwise.create(device=node.get_device(),
                                                 dtype=torch.bfloat16, inner_fn=fn,
                                                 ranges=node.get_size()))
                 for fn in (hi, lo))
    splits[id(node)] = (node, *pair)
    return pair


def _static_sizes(per_head):
    """Batch (symbolic) and the static num_heads, seq_len, head_dim of a [B,H,S,D] node."""
    batch, *static = per_head.get_size()
    return batch, [V.graph.sizevars.guard_int(s) for s in static]


def _template_inputs(attn_weights, grad_attn, per_head):
    """P contiguous, then the bf16 (hi, lo) pairs of grad_attn and the per-head tensors."""
    nodes = [_contiguous(attn_weights)]
    for node in (grad_attn, *per_head):
        nodes.extend(_split_bf16(node))
    return nodes


_ROWS_OP = torch.ops.vitattn_bwd.softmax_bwd_rows.default
_COLS_OP = torch.ops.vitattn_bwd.softmax_bwd_cols.default


@register_lowering(_ROWS_OP, type_promotion_kind=None)
def _lower_rows(attn_weights, grad_attn, k, v, scale):
    batch, (num_heads, seq_len, head_dim) = _static_sizes(k)
    if not _template_applies(k, head_dim):
        return fallback_handler(_ROWS_OP, add_to_fallback_set=False)(
            attn_weights, grad_attn, k, v, scale)
    device = k.get_device()
    delta = empty_strided([batch, num_heads, seq_len], None, dtype=torch.float32,
                          device=device)                                  # [B,H,S]
    layout = ir.FixedLayout(device, torch.float32,
                            [batch, seq_len, num_heads * head_dim])       # [B,S,E]
    constexprs = dict(SEQ_LEN=seq_len, NUM_HEADS=num_heads, HEAD_DIM=head_dim, SCALE=scale)
    inputs = [*_template_inputs(attn_weights, grad_attn, (k, v)), delta]
    choices = _tile_choices(ROWS_TEMPLATE, inputs, layout, [delta],
                            [batch, num_heads, seq_len], constexprs)
    grad_q = _node_of(autotune_select_algorithm(ROWS_TEMPLATE.name, choices, inputs, layout))
    return grad_q, delta


@register_lowering(_COLS_OP, type_promotion_kind=None)
def _lower_cols(attn_weights, grad_attn, q, v, delta, scale):
    batch, (num_heads, seq_len, head_dim) = _static_sizes(q)
    if not _template_applies(q, head_dim):
        return fallback_handler(_COLS_OP, add_to_fallback_set=False)(
            attn_weights, grad_attn, q, v, delta, scale)
    inputs = [*_template_inputs(attn_weights, grad_attn, (q, v)),
              ir.ExternKernel.require_contiguous(delta)]
    layout = ir.FixedLayout(q.get_device(), torch.float32,
                            [batch, seq_len, 2 * num_heads * head_dim])   # [B,S,2E]
    constexprs = dict(SEQ_LEN=seq_len, NUM_HEADS=num_heads, HEAD_DIM=head_dim, SCALE=scale)
    choices = _tile_choices(COLS_TEMPLATE, inputs, layout, None,
                            [batch, num_heads, seq_len], constexprs)
    return _node_of(autotune_select_algorithm(COLS_TEMPLATE.name, choices, inputs, layout))
