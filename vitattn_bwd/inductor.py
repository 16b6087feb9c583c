"""Everything that touches Inductor's and dynamo's private API: the compile options
(with the tag that puts our sources into Inductor's cache key), the attention-core and
split-GEMM Triton templates with their lowerings (so max-autotune weighs their configs),
whether dynamo still holds a function's compiled graphs (`holds_compiled_graphs`), and
whether Inductor's CUDA graph trees are warming up on this thread
(`cudagraph_trees_warming_up`).

Checked against torch 2.11 (the GPU machine), 2.13 (CPU development), 2.14.1 and 2.15;
the differences of this private API between versions are handled here and nowhere else
(public API that differs, as wrap_triton under the interpreter, beside its one user). A
missing API raises an ImportError naming the torch version: the package never falls back
silently.

The templates paste the device code of kernels/softmax_bwd.py (and kernels/split_gemm.py)
verbatim behind a thin entry point, so the kernels tested under TRITON_INTERPRET=1 are
the ones compiled here. The lowerings hand them grad_attn, q, k, v as bf16 (hi, lo)
pairs (or fp16 halves of scaled operands for precision "highest"), one pointwise pass
per tensor. On Hopper the Gluon kernels (softmax_bwd_gluon.py) are candidates beside the
templates' configs, as ExternKernelChoices (as Inductor keeps cuBLAS among its mm
configs); bf16 / fp16 operands (the module's one-product path) go to them alone.
"""
import contextlib
import functools
import inspect
import sys
import weakref

import sympy
import torch

try:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._inductor import ir
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.lowering import empty_strided, fallback_handler, register_lowering
    from torch._inductor.select_algorithm import (ExternKernelChoice, SymbolicGridFn,
                                                  TritonTemplate, autotune_select_algorithm)
    from torch._inductor.virtualized import V, ops
except ImportError as error:              # pragma: no cover - depends on the torch build
    raise ImportError(f"vitattn_bwd needs Inductor and dynamo APIs that torch "
                      f"{torch.__version__} lacks ({error}); it was written against torch "
                      "2.11-2.14") from error

from . import softmax_bwd, softmax_bwd_gluon, split_gemm
from .softmax_bwd import TileConfig
from .split_gemm import GemmTiles
from .precision import (BF16_HI_MASK, BF16_ROUNDING_BIAS, FP16_HI_MASK, FP16_ROUNDING_BIAS,
                        Products)

# The configs max-autotune times against each other for both templates: the rows pass's
# fastest at batch 32 (64, 32, 4, 3), the cols pass's (64, 64, 4, 2), and (32, 64, 4, 3)
# for small batches (more programs). Every one compiles for sm_90 without register
# spills (tests/test_kernel_resources.py); larger tiles left one program per SM or
# spilled (performance.md, "Ruled out").
TILE_CONFIGS = (
    TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=3),
    TileConfig(block_m=32, block_n=64, num_warps=4, num_stages=3),
)


class CacheKeyTag(CustomGraphPass):
    """A pass that does nothing; Inductor hashes its uuid into the FX graph cache key,
    so compiled graphs are keyed by our sources too (Inductor hashes torch's own only).
    Given per compile through torch.compile(options=...): no process-wide setting."""

    def __init__(self, tag):
        self.tag = tag

    def __call__(self, graph):
        return None

    def uuid(self):
        return self.tag


def compile_options(tag, *, max_autotune, cpp_wrapper=False):
    """torch.compile options of one of our graphs. cpp_wrapper: Inductor's generated
    wrapper is C++, which launches the kernels without Python per kernel. No epilogue or prologue fusion: our
    templates store their outputs themselves and read their inputs through raw pointers
    (a pointwise node fused into them would read buffers that are never written, or read
    back the halves before every thread of the program has stored them). No
    coordinate-descent tuning: in torch 2.11 it re-runs on warm cache loads (pytorch
    issue 172819). No CUDA graph trees: small batches are captured by cuda_graphs.py,
    which works on autograd's threads too. Max-autotune offers only GEMM configs whose
    shared memory (Inductor's estimate, an upper bound) fits the device: by default
    torch 2.11-2.13 offer float32 tiles needing 256 KB on an H200 (227 KB), which fail
    to compile and are logged at error level ("No valid triton configs"), though the
    step runs right."""
    options = {"post_grad_custom_post_pass": CacheKeyTag(tag), "epilogue_fusion": False,
               "prologue_fusion": False}
    if max_autotune:
        options.update(max_autotune=True,
                       max_autotune_prune_choices_based_on_shared_mem=True)
    if cpp_wrapper:
        options["cpp_wrapper"] = True
    return options


def holds_compiled_graphs(code):
    """Whether dynamo holds a compiled graph for the code object `code` (a function
    torch.compile wrapped): False before its first compile and after
    torch._dynamo.reset() / torch.compiler.reset(), which drop every compiled graph.
    About 1 us on the host."""
    return bool(_debug_get_cache_entry_list(code))


def cudagraph_trees_warming_up(device_index):
    """Whether this thread runs inside a warm-up run of Inductor's CUDA graph trees
    (torch.compile's "reduce-overhead") on GPU `device_index`: their memory pool then
    takes every allocation this thread makes, and must hold only what their graph
    returns. Such a run switches to its tree manager's stream, so the current stream
    tells. No trees in use (the module never imported, none set up on this thread or
    device): False."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    name = "tree_manager_containers"
    if not hasattr(trees.local, name) and not torch._C._is_key_in_tls(name):
        return False
    container = trees.get_obj(trees.local, name).get(device_index)
    manager = None if container is None else container.tree_manager
    return (manager is not None
            and torch.cuda.current_stream(device_index) == manager.stream)


# ---- the attention-core templates ----------------------------------------------------

# Template constexprs: SEQ_LEN, NUM_HEADS, HEAD_DIM (tiles padded_head_dim wide, the
# padding columns pointing past the row, which `mask` drops), BLOCK_M, BLOCK_N, SCALE,
# RECOMPUTE_P (False: P is read from PROBS; True: it is recomputed from its log-sum-exp
# LSE, and the rows pass reads the forward's output ATTN_OUT; each of PROBS, LSE and
# ATTN_OUT not read is a 1-element placeholder), SUM_ROWS (the rows per partial sum in
# GRAD_Q_SUMS / GRAD_KV_SUMS).
_ROWS_ENTRY = r'''
{{def_kernel("PROBS", "LSE", "GRAD_ATTN_HI", "GRAD_ATTN_LO", "Q_HI", "Q_LO", "K_HI", "K_LO", "V_HI", "V_LO", "ATTN_OUT", "DELTA", "GRAD_Q_HALVES", "GRAD_Q_SUMS")}}
    batch, rows, cols, grad_q16 = softmax_bwd_rows_program(
        PROBS, LSE, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO, V_HI, V_LO, ATTN_OUT,
        DELTA, GRAD_Q_HALVES, GRAD_Q_SUMS, SCALE, SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M,
        BLOCK_N, RECOMPUTE_P, SUM_ROWS)
    HEAD_TILE: tl.constexpr = padded_head_dim(HEAD_DIM)
    mask = (rows < SEQ_LEN) & (cols < NUM_HEADS * HEAD_DIM)
    {{store_output(("batch", "rows", "cols"), "grad_q16", "mask", val_shape=("BLOCK_M", "HEAD_TILE"))}}

'''

_COLS_ENTRY = r'''
{{def_kernel("PROBS", "LSE", "GRAD_ATTN_HI", "GRAD_ATTN_LO", "Q_HI", "Q_LO", "K_HI", "K_LO", "V_HI", "V_LO", "DELTA", "GRAD_KV_HALVES", "GRAD_KV_SUMS")}}
    batch, rows, cols, grad_kv16 = softmax_bwd_cols_program(
        PROBS, LSE, GRAD_ATTN_HI, GRAD_ATTN_LO, Q_HI, Q_LO, K_HI, K_LO, V_HI, V_LO, DELTA,
        GRAD_KV_HALVES, GRAD_KV_SUMS, SCALE, SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_M,
        BLOCK_N, RECOMPUTE_P, SUM_ROWS)
    KV_WIDTH: tl.constexpr = 2 * padded_head_dim(HEAD_DIM)
    mask = (rows < SEQ_LEN) & (cols < 2 * NUM_HEADS * HEAD_DIM)
    {{store_output(("batch", "rows", "cols"), "grad_kv16", "mask", val_shape=("BLOCK_N", "KV_WIDTH"))}}

'''


def device_functions(module=None):
    """The @triton.jit functions of a kernels module (kernels/softmax_bwd.py unless
    given) that its templates paste in: all but the raw kernels, in source order."""
    if module is None:
        from .kernels import softmax_bwd as module
    functions = [obj for name, obj in vars(module).items()           # jit or interpreted
                 if inspect.isfunction(getattr(obj, "fn", None)) and not name.endswith("_kernel")]
    return sorted(functions, key=lambda jit: jit.fn.__code__.co_firstlineno)


def _device_source(module=None):
    """Source of a kernels module's shared device functions, protected from Jinja."""
    sources = [inspect.getsource(jit.fn) for jit in device_functions(module)]
    return "{% raw %}\n" + "\n\n".join(sources) + "{% endraw %}\n"


@SymbolicGridFn
def _rows_grid(batch, num_heads, seq_len, meta, *, cdiv):
    return (cdiv(seq_len, meta["BLOCK_M"]) * batch * num_heads, 1, 1)   # program_block


@SymbolicGridFn
def _cols_grid(batch, num_heads, seq_len, meta, *, cdiv):
    return (cdiv(seq_len, meta["BLOCK_N"]) * batch * num_heads, 1, 1)


@functools.cache
def _templates():
    """(rows, cols) templates, made at the first lowering (a template name may be
    defined once per process, and this needs triton)."""
    source = _device_source()
    return (TritonTemplate(name="vitattn_softmax_bwd_rows", grid=_rows_grid,
                           source=_ROWS_ENTRY + source),
            TritonTemplate(name="vitattn_softmax_bwd_cols", grid=_cols_grid,
                           source=_COLS_ENTRY + source))


# Autotuning times each choice on inputs of its own (select_algorithm's example values),
# allocated beside the caller's tensors. Where a lowering's inputs take more than this
# fraction of the device's memory, its first choice is taken untimed: at batch 1,850 the
# contract's P alone is 36.7 GiB, and its copy for timing ran out of memory there.
AUTOTUNE_MAX_INPUT_FRACTION = 1 / 8


def _fits_autotuning(inputs):
    """Whether copies of `inputs` (IR nodes, at their size hints) take at most
    AUTOTUNE_MAX_INPUT_FRACTION of their CUDA device's memory."""
    device = inputs[0].get_device()
    if device.type != "cuda":
        return True
    hint = V.graph.sizevars.optimization_hint          # torch 2.11 to 2.14
    input_bytes = sum(hint(node.get_numel(), fallback=0) * node.get_dtype().itemsize
                      for node in inputs)
    return input_bytes <= (AUTOTUNE_MAX_INPUT_FRACTION
                           * torch.cuda.get_device_properties(device).total_memory)


def _select(template, choices, inputs, layout):
    """The tuned template's output node (the first choice, untimed, where the inputs
    are too large to copy for timing: _fits_autotuning). Selected now, not deferred to
    the scheduler (return_multi_template=False): a deferred choice is a
    MultiTemplateBuffer, which drops the mutated inputs, so the scheduler would not
    order the readers of our halves and delta after the template (seen on the H200:
    they ran before it)."""
    if not _fits_autotuning(inputs):
        choices = choices[:1]
    selected = autotune_select_algorithm(template.name, choices, inputs, layout,
                                         return_multi_template=False)
    return selected[0] if isinstance(selected, tuple) else selected


def block_constexprs(tiles):
    """The block-size constexprs of a TileConfig or GemmTiles: BLOCK_M, BLOCK_N (and
    BLOCK_K) from its block_m, block_n (and block_k)."""
    return {f"BLOCK_{name[-1].upper()}": size for name, size in tiles._asdict().items()
            if name.startswith("block_")}


def _tile_choices(template, tile_configs, input_nodes, layout, constexprs, **choice_args):
    """One choice of `template` per config of tile_configs, with `constexprs` and any
    further maybe_append_choice arguments (mutated_inputs, call_sizes)."""
    choices = []
    for tiles in tile_configs:
        template.maybe_append_choice(
            choices, input_nodes=input_nodes, layout=layout, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages, **block_constexprs(tiles), **constexprs,
            **choice_args)
    if not choices:
        raise RuntimeError(f"{template.name}: no template config could be generated")
    return choices


# ---- the Gluon kernels as autotune candidates ------------------------------------------
# Each Gluon tile config is an ExternKernelChoice bound to the template's inputs (which
# include the delta / halves buffers the kernel fills) and its tiles. Timing calls
# softmax_bwd_gluon.rows_out / cols_out on them. The winner's node is made by `_gluon_node`: a
# FallbackKernel of the functional operator gluon_softmax_bwd_rows / _cols, so Inductor
# sees all its outputs as outputs of the node it schedules; the lowering then returns
# those (`_gluon_outputs`) instead of the template's buffers, which nothing writes or
# reads and Inductor drops. (An extern kernel writing into its inputs would leave their
# readers unordered.)


def _gluon_node(op):
    """kernel_creator of a Gluon choice: the functional operator `op` on the choice's
    operands (the tensors of op's schema before `scale`: probs and lse first, the one
    recompute_p does not name passed as None) and, where the operands are fp16 halves,
    on the operand scales, the input after the buffers that op returns besides its
    first output."""
    arguments = [argument.name for argument in op._schema.arguments]
    operand_count = arguments.index("scale")
    buffer_count = len(op._schema.returns) - 1

    def create(*input_nodes, scale, block_m, block_n, num_warps, num_stages, products,
               recompute_p):
        probs, lse, *operands = input_nodes[:operand_count]
        probs, lse = (None, lse) if recompute_p else (probs, None)
        operand_scales = input_nodes[operand_count + buffer_count:]
        outputs = ir.FallbackKernel.create(op, probs, lse, *operands, scale, block_m,
                                           block_n, num_warps, num_stages, products,
                                           *operand_scales)
        return outputs[0]
    return create


def _gluon_outputs(selected):
    """Every output of the Gluon operator where a Gluon choice won (`selected`, the
    selection's node, is then its first output), else None."""
    node = selected
    while isinstance(node, (ir.TensorBox, ir.StorageBox)):
        node = node.data
    if isinstance(node, ir.MultiOutput) and isinstance(node.inputs[0], ir.FallbackKernel):
        return node.inputs[0].outputs
    return None


@functools.cache
def _gluon_choices():
    """(rows, cols) ExternKernelChoices of the Gluon kernels (one per process)."""
    rows_op = torch.ops.vitattn_bwd.gluon_softmax_bwd_rows.default
    cols_op = torch.ops.vitattn_bwd.gluon_softmax_bwd_cols.default
    return (ExternKernelChoice(softmax_bwd_gluon.rows_out,
                               name="vitattn_gluon_softmax_bwd_rows",
                               kernel_creator=_gluon_node(rows_op)),
            ExternKernelChoice(softmax_bwd_gluon.cols_out,
                               name="vitattn_gluon_softmax_bwd_cols",
                               kernel_creator=_gluon_node(cols_op)))


def _gluon_tile_choices(choice, tile_configs, tensor_node, head_dim, inputs, layout, scale,
                        products, recompute_p):
    """The Gluon candidates where the kernels run (Hopper, softmax_bwd_gluon.HEAD_DIMS), with
    the operator's products (a Products, bound as its value)."""
    dtype = tensor_node.get_dtype()
    if not softmax_bwd_gluon.available(tensor_node.get_device(), dtype, head_dim):
        return []
    return [choice.bind(inputs, layout, scale=scale, block_m=tiles.block_m,
                        block_n=tiles.block_n, num_warps=tiles.num_warps,
                        num_stages=tiles.num_stages, products=products.value,
                        recompute_p=recompute_p)
            for tiles in tile_configs]


def _selected_outputs(template, choices, inputs, layout, template_outputs):
    """The tuned choice's outputs: the template's node and its mutated buffers, or all
    outputs of the Gluon operator if a Gluon choice won."""
    first = _select(template, choices, inputs, layout)
    winner = _gluon_outputs(first)
    if winner is None:
        return (first, *template_outputs)
    return (first, *(ir.TensorBox.create(node) for node in winner[1:]))


def _template_applies(tensor_node, head_dim):
    return softmax_bwd.triton_supports(tensor_node.get_device().type,
                                       tensor_node.get_dtype(), head_dim)


def _kernels_apply(tensor_node, head_dim, fp16_halves):
    """Whether any of our kernels takes these operands: the templates (float32, bf16
    halves), or the Gluon kernels (Hopper; float32, bf16 and fp16). Elsewhere the
    operator's own implementation runs."""
    return ((_template_applies(tensor_node, head_dim) and not fp16_halves)
            or softmax_bwd_gluon.available(tensor_node.get_device(),
                                           tensor_node.get_dtype(), head_dim))


def _contiguous(node):
    return ir.ExternKernel.realize_input(ir.ExternKernel.require_contiguous(node))


def _pointwise(node, dtype, inner_fn):
    return _contiguous(ir.Pointwise.create(device=node.get_device(), dtype=dtype,
                                           inner_fn=inner_fn, ranges=node.get_size()))


# Per graph being lowered: (buffer name, offset, size, stride) of a realized float32
# node -> (hi, lo). grad_attn and v feed both passes; they are split once. The offset
# matters: a view that is already contiguous is not copied, and keeps its buffer's name.
# The module's q, k and v at batch 1 and one token are such views of one qkv buffer,
# with equal sizes and strides (size-1 dimensions); keyed without the offset, k and v
# were given q's halves (found on the H200 by the module's property test).
_SPLITS = weakref.WeakKeyDictionary()


def _split_key(node):
    """What identifies the values of a realized node: its buffer, offset and strides."""
    layout = node.get_layout()
    return (node.get_name(), layout.offset, tuple(layout.size), tuple(layout.stride))


def _rounded(value, bias, shift, mask):
    """float32 `value` (an ops value) rounded to nearest even at bit `shift` by integer
    operations (no cast to fold away), as a float32 ops value."""
    bits = ops.to_dtype_bitcast(value, torch.int32, torch.float32)
    odd = ops.bitwise_and(ops.bitwise_right_shift(bits, ops.constant(shift, torch.int32)),
                          ops.constant(1, torch.int32))
    rounded = ops.add(ops.add(bits, ops.constant(bias, torch.int32)), odd)
    masked = ops.bitwise_and(rounded, ops.constant(mask, torch.int32))
    return ops.to_dtype_bitcast(masked, torch.float32, torch.int32)


# How the lowering splits a float32 operand into (hi, lo): their dtype, and the bias,
# bit and mask that round hi to nearest even by integer operations (so no cast can be
# folded away). bf16 halves: precision.split_bf16_rounded, rounded because the Gluon
# kernels split their S x S tiles by truncation (one rounded and one truncated operand
# per product keep the neglected lo * lo term at 2^-15 of the product). fp16 halves
# (precision "highest"): precision.split_fp16, of the operand scaled into fp16's range.
_BF16_SPLIT = (torch.bfloat16, BF16_ROUNDING_BIAS, 16, BF16_HI_MASK)
_FP16_SPLIT = (torch.float16, FP16_ROUNDING_BIAS, 13, FP16_HI_MASK)


def _split(node, split, operand_scales=None, index=None):
    """Realized, contiguous (hi, lo) buffers of a float32 IR node, split as `split` says
    (_BF16_SPLIT or _FP16_SPLIT), of the node times the power of two
    operand_scales[index] where operand_scales (a realized node) is given; emitted as
    pointwise IR, once per graph for each node and scale."""
    dtype, bias, shift, mask = split
    node = _contiguous(node)
    scaled_by = () if operand_scales is None else (operand_scales.get_name(), index)
    key = (*_split_key(node), dtype, *scaled_by)
    splits = _SPLITS.setdefault(V.graph, {})
    if key in splits:
        return splits[key]
    load = node.make_loader()
    if operand_scales is not None:
        load_unscaled, load_scale = load, operand_scales.make_loader()

        def load(index_):
            return ops.mul(load_unscaled(index_), load_scale([sympy.Integer(index)]))

    def hi_float32(index_):
        return _rounded(load(index_), bias, shift, mask)

    def hi(index_):
        return ops.to_dtype(hi_float32(index_), dtype)

    def lo(index_):
        return ops.to_dtype(ops.sub(load(index_), hi_float32(index_)), dtype)

    splits[key] = tuple(_pointwise(node, dtype, fn) for fn in (hi, lo))
    return splits[key]


def _static_sizes(per_head):
    """Batch (symbolic) and the static num_heads, seq_len, head_dim of a [B,H,S,D] node."""
    batch, *static = per_head.get_size()
    return batch, [V.graph.sizevars.guard_int(s) for s in static]


_ROWS_OP = torch.ops.vitattn_bwd.softmax_bwd_rows.default
_COLS_OP = torch.ops.vitattn_bwd.softmax_bwd_cols.default


def _as_they_lie(q, k, v):
    """bf16 / fp16 q, k, v [B,H,S,D] for the Gluon kernels: where they lie if they share
    strides with a contiguous last dim and 16-byte aligned rows (the module's views of
    its QKV projection [B,S,3E], which the kernels read with row stride 3E: copying them
    contiguous took 0.15 ms of a 2 ms block step at batch 32 on the H200), else
    contiguous copies."""
    nodes = [ir.ExternKernel.realize_input(t) for t in (q, k, v)]
    strides = {tuple(node.get_stride()) for node in nodes}
    aligned = all(V.graph.sizevars.statically_known_equals(value % 8, 0)
                  for node in nodes for value in (*node.get_stride()[:-1],
                                                  node.get_layout().offset))
    if len(strides) == 1 and nodes[0].get_stride()[-1] == 1 and aligned:
        return nodes
    return [_contiguous(t) for t in (q, k, v)]


def _operands(probs, lse, grad_attn, q, k, v, products, operand_scales):
    """Kernel inputs PROBS .. V_LO: the one of probs and lse given contiguous, the other
    a placeholder (_placeholder), the rest by products: bf16 (hi, lo) pairs of
    float32 tensors (contiguous) for bf16x3, fp16 (hi, lo) pairs of them scaled by
    operand_scales (a realized node) for fp16x3, or with one product bf16 / fp16 tensors
    as they are, each twice (hi; lo unread): grad_attn contiguous, q, k, v where they
    lie (`_as_they_lie`)."""
    device = k.get_device()
    probs_and_lse = [_placeholder(device) if t is None else _contiguous(t)
                     for t in (probs, lse)]
    if products.fp16_halves:
        return [*probs_and_lse, *(part for index, t in enumerate((grad_attn, q, k, v))
                                  for part in _split(t, _FP16_SPLIT, operand_scales,
                                                     index))]
    if products.count == 1:
        return [*probs_and_lse, *(t for t in [_contiguous(grad_attn), *_as_they_lie(q, k, v)]
                                  for _ in range(2))]
    return [*probs_and_lse, *(part for t in (grad_attn, q, k, v)
                              for part in _split(t, _BF16_SPLIT))]


def _placeholder(device):
    """A 1-element float32 buffer for a kernel input that is not read."""
    return empty_strided([1], None, dtype=torch.float32, device=device)


def _constexprs(num_heads, seq_len, head_dim, scale, recompute_p):
    return dict(SEQ_LEN=seq_len, NUM_HEADS=num_heads, HEAD_DIM=head_dim, SCALE=scale,
                RECOMPUTE_P=recompute_p, SUM_ROWS=softmax_bwd.COLUMN_SUM_ROWS)


def _column_sums_buffer(batch, seq_len, width, device):
    """The float32 partial sums over rows a pass writes: [B, sum_groups(S), width]."""
    return empty_strided([batch, softmax_bwd.sum_groups(seq_len), width], None,
                         dtype=torch.float32, device=device)


def _scales_input(operand_scales):
    """The operand scales as a realized input of the kernels, or None."""
    return None if operand_scales is None else _contiguous(operand_scales)


def _lower_pass(op, grad_attn, q, k, v, pass_input, scale, products_value, probs, lse,
                operand_scales):
    """The lowering of either pass (op: _ROWS_OP or _COLS_OP; pass_input: the rows pass's
    attention output, None where P is given, or the cols pass's delta; products_value:
    the operator's products, a Products' value; one of probs and lse, the other None, and
    operand_scales with fp16x3, as the operator checked when traced): the outputs of
    the selected kernel, among the Gluon configs (first: the choice taken untimed where
    autotuning cannot fit) and the template's; the operator's own implementation where
    none of our kernels takes these operands."""
    batch, (num_heads, seq_len, head_dim) = _static_sizes(k)
    products = Products(products_value)
    if not _kernels_apply(k, head_dim, products.fp16_halves):
        return fallback_handler(op, add_to_fallback_set=False)(
            grad_attn, q, k, v, pass_input, scale, products_value, probs, lse,
            operand_scales)
    rows = op is _ROWS_OP
    device = k.get_device()
    width = num_heads * head_dim * (1 if rows else 2)          # E for dQ, 2E for dK | dV
    halves = empty_strided([batch, seq_len, products.halves_width(width)],
                           None, dtype=torch.bfloat16, device=device)  # [B,S,2E] / [B,S,4E]
    sums = _column_sums_buffer(batch, seq_len, width, device)  # [B,G,E] / [B,G,2E]
    layout = ir.FixedLayout(device, products.gradient_dtype,
                            [batch, seq_len, width])           # [B,S,E] / [B,S,2E]
    if rows:
        if pass_input is None:       # P given: ATTN_OUT is not read
            pass_input = _placeholder(device)
        pass_input = _contiguous(pass_input)
        delta = empty_strided([batch, num_heads, seq_len], None, dtype=torch.float32,
                              device=device)                   # [B,H,S]
        buffers, outputs = (delta, halves, sums), (halves, delta, sums)
    else:
        pass_input = ir.ExternKernel.require_contiguous(pass_input)
        buffers = outputs = (halves, sums)
    operand_scales = _scales_input(operand_scales)
    inputs = [*_operands(probs, lse, grad_attn, q, k, v, products, operand_scales),
              pass_input, *buffers]
    if products.fp16_halves:
        inputs.append(operand_scales)
    pass_index = 0 if rows else 1
    template = _templates()[pass_index]
    gluon_tiles = (softmax_bwd_gluon.rows_tiles,
                   softmax_bwd_gluon.cols_tiles)[pass_index](head_dim)
    recompute_p = lse is not None
    choices = _gluon_tile_choices(_gluon_choices()[pass_index], gluon_tiles, k, head_dim,
                                  inputs, layout, scale, products, recompute_p)
    if _template_applies(k, head_dim) and not products.fp16_halves:
        choices += _tile_choices(template, TILE_CONFIGS, inputs, layout,
                                 _constexprs(num_heads, seq_len, head_dim, scale,
                                             recompute_p),
                                 mutated_inputs=list(buffers),
                                 call_sizes=[batch, num_heads, seq_len])
    return _selected_outputs(template, choices, inputs, layout, outputs)


@register_lowering(_ROWS_OP, type_promotion_kind=None)
def _lower_rows(grad_attn, q, k, v, attn_output, scale, products, probs=None, lse=None,
                operand_scales=None):
    return _lower_pass(_ROWS_OP, grad_attn, q, k, v, attn_output, scale, products, probs,
                       lse, operand_scales)


@register_lowering(_COLS_OP, type_promotion_kind=None)
def _lower_cols(grad_attn, q, k, v, delta, scale, products, probs=None, lse=None,
                operand_scales=None):
    return _lower_pass(_COLS_OP, grad_attn, q, k, v, delta, scale, products, probs, lse,
                       operand_scales)


# ---- the split GEMM template (precision "highest") -------------------------------------

# The template's offsets are of Inductor's INDEX_DTYPE (both torch 2.11 and 2.13 define
# it for templates): int64 where an input's storage or the output reaches 2^31
# elements, else int32 under a guard (a bigger batch recompiles the graph).
# The configs max-autotune times against each other for the split GEMM (split_gemm.py).
# Each keeps two [BLOCK_M, BLOCK_N] float32 accumulators (the running sum and the
# slice's partial) in registers.
GEMM_TILES = (
    GemmTiles(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4),
    GemmTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    GemmTiles(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3),
    GemmTiles(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
)

_SPLIT_GEMM_ENTRY = r'''
{{def_kernel("A_HI", "A_LO", "B_HI", "B_LO", "UNSCALE")}}
    M = {{size("A_HI", 0)}}
    N = {{size("B_HI", 1)}}
    K = {{size("A_HI", 1)}}
    tile_m, tile_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = split_gemm_tile(A_HI, A_LO, B_HI, B_LO, M, N, K, {{stride("A_HI", 0)}},
                          {{stride("A_HI", 1)}}, {{stride("B_HI", 0)}},
                          {{stride("B_HI", 1)}}, tile_m, tile_n, BLOCK_M, BLOCK_N, BLOCK_K,
                          INDEX_DTYPE)
    acc = unscaled(acc, UNSCALE)
    rows = tile_m.to(INDEX_DTYPE) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tile_n.to(INDEX_DTYPE) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < M) & (cols < N)
    {{store_output(("rows", "cols"), "acc", "mask", val_shape=("BLOCK_M", "BLOCK_N"))}}

'''


@SymbolicGridFn
def _gemm_grid(m, n, meta, *, cdiv):
    return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), 1, 1)


@functools.cache
def _gemm_template():
    from .kernels import split_gemm as kernels
    return TritonTemplate(name="vitattn_split_gemm", grid=_gemm_grid,
                          source=_SPLIT_GEMM_ENTRY + _device_source(kernels))


def _gemm_operand(node):
    """A realized 2-d operand as it lies if it is contiguous or a transposed view of a
    contiguous buffer (A^T of a weight gradient), else a contiguous copy."""
    node = ir.ExternKernel.realize_input(node)
    (rows, _), stride = node.get_size(), node.get_stride()
    known = V.graph.sizevars.statically_known_equals
    if isinstance(node, ir.ReinterpretView) and known(stride[0], 1) and known(stride[1], rows):
        return node
    return _contiguous(node)


_SPLIT_GEMM_OP = torch.ops.vitattn_bwd.split_gemm.default


@register_lowering(_SPLIT_GEMM_OP, type_promotion_kind=None)
def _lower_split_gemm(a_hi, a_lo, b_hi, b_lo, unscale):
    if a_hi.get_device().type != "cuda":
        return fallback_handler(_SPLIT_GEMM_OP, add_to_fallback_set=False)(
            a_hi, a_lo, b_hi, b_lo, unscale)
    operands = [_gemm_operand(t) for t in (a_hi, a_lo, b_hi, b_lo)]
    if (operands[0].get_stride() != operands[1].get_stride()
            or operands[2].get_stride() != operands[3].get_stride()):
        operands = [_contiguous(t) for t in operands]       # the halves share strides
    (M, _), (_, N) = operands[0].get_size(), operands[2].get_size()
    layout = ir.FixedLayout(operands[0].get_device(), torch.float32, [M, N])   # [M,N]
    inputs = [*operands, _contiguous(unscale)]
    template = _gemm_template()
    choices = _tile_choices(template, GEMM_TILES, inputs, layout,
                            dict(GROUP_M=split_gemm.GROUP_M))
    return _select(template, choices, inputs, layout)


@contextlib.contextmanager
def recorded_autotune_choices():
    """A list that collects, while the context is open, one (operation, input sizes,
    winner, {choice: ms}) per selection Inductor's autotuning times in this process
    (`scripts/time_kernels.py --kernel margin` prints them; a graph loaded from a warm
    cache times nothing).
    Through Inductor's feedback-saver hook, removed again on exit."""
    from torch._inductor import select_algorithm
    records = []

    def save(timings, name, input_nodes, *_):
        def described(choice):
            return f"{choice.name} {getattr(choice, 'description', '')}".strip()
        sizes = [tuple(str(size) for size in node.get_size()) for node in input_nodes]
        winner = min(timings, key=timings.get) if timings else None
        records.append((name, sizes, winner and described(winner),
                        {described(choice): ms for choice, ms in timings.items()}))

    selectors = select_algorithm.get_algorithm_selector_cache()
    selectors.add_feedback_saver(save)
    try:
        yield records
    finally:
        selectors.feedback_saver_fns.remove(save)
