"""Swap the attention half of Hugging Face vision towers for vitattn_bwd's fused block.

    from transformers import CLIPVisionModel
    from vitattn_bwd.integrations.hf import swap_attention

    model = CLIPVisionModel.from_pretrained(path)
    swap_attention(model)          # in place; returns the model

Every encoder layer of a vision tower whose attention half is LayerNorm -> q/k/v/out
Linear projections -> softmax attention -> residual runs that half as
`vitattn_bwd.module.vision_attention` (the fused backward, float32-grade, or at
precision "medium" one product per matmul; at precision None the stock ops under
autocast and for an all-bf16/fp16 model, where they were the faster:
vitattn_bwd.routing). Matched:
- CLIP / SigLIP style (CLIPEncoderLayer, SiglipEncoderLayer, ...): `layer_norm1`,
  `self_attn.{q_proj,k_proj,v_proj,out_proj}` (and no other submodule but dropouts),
  then `layer_norm2` and `mlp`, in a layer whose forward is CLIPEncoderLayer.forward's
  code (transformers copies it into SigLIP, SigLIP2, Idefics2/3, OwlViT, AltCLIP, Kosmos-2
  and others' layers) or whose class is registered (`register_classes`); a layer whose
  forward computes more (X-CLIP's message token, MLCD's or VideoLlama3's rotary
  embeddings) is refused at the swap, and arguments the fused block would leave out
  (position_embeddings, cu_seqlens, ...) at the call;
- Molmo style (ResidualAttentionBlock): `attention_norm`, `attention.{wq,wk,wv,wo}`,
  then `ffn_norm` and `feed_forward`, in a layer that computes x + attention(
  attention_norm(x)), then x + feed_forward(ffn_norm(x)), with plain softmax attention;
  or, with per-channel layer scales `lambda1` / `lambda2` of shape [E] (Molmo's
  DinoResidualAttentionBlock, as in DINOv2 towers), x + attention(attention_norm(x)) *
  lambda1, then x + feed_forward(ffn_norm(x)) * lambda2: lambda1 is folded into the out
  projection as timm's LayerScale is (vitattn_bwd.module.vision_attention's gamma, which
  gets its gradient), lambda2 multiplies the stock feed-forward half. Its code has no
  reference in transformers, so the swap runs a CPU copy of the layer (random
  parameters, the layer scales included) on random tokens against that math and refuses
  a layer that differs (a causal mask, rotary embeddings, a layer scale used otherwise)
  or cannot be checked, unless its class is registered (`register_classes`).

How: each matched layer keeps its own submodules and parameters (so state_dict keys,
checkpoints, save_pretrained/from_pretrained, optimizers and hooks on the layer are
unchanged) and gets a subclass of its own class whose forward concatenates the q/k/v
weights into the [3E,E] matrix at each call (gradients flow back through the
concatenation into q_proj/k_proj/v_proj) and uses the layer's own eps and num_heads. Being
a subclass, the layer still matches transformers' isinstance checks: the output-capture
hooks of transformers 5 (output_hidden_states) attach to it whether they were installed
before or after the swap, and gradient checkpointing works. `unswap_attention` restores
the stock classes.

Limits: no attention mask (vision towers pass none; a mask raises ValueError), no
output_attentions (raises ValueError: the attention maps are never materialized for the
caller), no attention dropout (a layer with attention dropout > 0 is refused at the swap,
and a dropout or scale set after the swap at its next call),
no double backward, no projection whose forward is not nn.Linear's (an adapter: the
fused block reads the projections' weights and biases only; refused at the swap, and at
the call if put in place after it). A layer whose forward is overridden on the instance
(accelerate's device_map hooks), or with forward or backward hooks on `layer_norm1`, `self_attn` or any
module under them (whose forwards the fused block does not call), is refused at the swap;
hooks on the layer itself work, and transformers 5's own output-capture hooks on
`self_attn` are let through (they capture attention maps only, which are refused at the
call). Hooks put on those submodules after the swap do not fire. By default only layers
inside a module whose class name contains "Vision" are swapped, so a CLIPModel's text
tower stays stock.

Works with transformers 4.4x (layers return a tuple and take output_attentions) and 5.x
(layers return a tensor; kwargs), and inside torch.compile(model) without a graph break
(fullgraph=True compiles): the swapped forward binds its arguments without inspect and
decides output_attentions without reading transformers 5's context variable while
dynamo traces (_attentions_requested).
"""
import ast
import copy
import functools
import inspect
import math
import sys
import textwrap

import torch
from torch import nn

from ..module import stock_forward
from ..validation import check_config
from . import _common

__all__ = ["swap_attention", "unswap_attention", "swapped_layers", "is_swapped",
           "register_classes"]

_FUSED_CLASSES = {}        # stock layer class -> its fused subclass
_REGISTERED_LAYERS = []    # register_classes(layer=...)
is_swapped = _common.is_swapped
swapped_layers = _common.swapped_layers

# What a swapped CLIP-style layer's forward may be given besides hidden_states (values
# other than None): masks (refused at the call), and transformers' output flags. Any
# other argument (rotary position_embeddings, packed-sequence cu_seqlens, ...) is a
# computation the fused block would leave out, and refused by name.
_LAYER_ARGUMENTS = ("attention_mask", "causal_attention_mask", "output_attentions",
                    "output_hidden_states", "return_dict")


def register_classes(*, layer=()):
    """Declare layer classes whose forward is exactly the swapped layer's math (x +
    attention half, then x + MLP half), so that swap_attention swaps them without
    checking their code: Hugging Face style ones (layer_norm1, self_attn.q/k/v/out_proj,
    layer_norm2, mlp) whose code differs from CLIPEncoderLayer.forward's, and Molmo-style
    ones, which then skip the swap's check on random tokens. Classes whose forward
    computes anything else must not be registered."""
    for cls in (layer,) if isinstance(layer, type) else layer:
        if cls not in _REGISTERED_LAYERS:
            _REGISTERED_LAYERS.append(cls)


@functools.cache
def _forward_code(fn):
    """fn's syntax tree without its name, docstring, decorators and annotations, as a
    string (made once per function: CLIPEncoderLayer.forward's is the reference for
    every layer class); None where its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    tree.name, tree.decorator_list, tree.returns = "forward", [], None
    arguments = tree.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                     arguments.vararg, arguments.kwarg):
        if argument is not None:
            argument.annotation = None
    if tree.body and isinstance(tree.body[0], ast.Expr) \
            and isinstance(tree.body[0].value, ast.Constant):
        tree.body = tree.body[1:]
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(None)
    return ast.dump(tree)


def _runs_clips_forward(cls):
    """Whether an unregistered CLIP-style layer class computes what the swapped layer
    does: its forward's code is transformers' CLIPEncoderLayer.forward's (the installed
    version's), as transformers copies it into SigLIP, Idefics2, OwlViT and some 25
    other models' layers. A layer whose forward adds anything (X-CLIP's cross-frame
    message token, MLCD's rotary embeddings) is not."""
    try:
        from transformers.models.clip.modeling_clip import CLIPEncoderLayer
    except ImportError:                 # without transformers: registered classes only
        return False
    if cls.forward is CLIPEncoderLayer.forward:
        return True
    code = _forward_code(cls.forward)
    return code is not None and code == _forward_code(CLIPEncoderLayer.forward)


def _runs_transformers_attention(attn_cls):
    """Whether an unregistered CLIP-style layer's attention module runs transformers' own
    forward (one defined in transformers.models, as CLIPAttention's and its copies in
    SigLIP, Idefics2 and the others are): a user's subclass with a forward of its own
    (attention editing, extra terms) does not."""
    return getattr(attn_cls.forward, "__module__", "").startswith("transformers.models.")


def _layer_norm(module, name):
    ln = getattr(module, name, None)
    return ln if isinstance(ln, nn.LayerNorm) else None


# Layer conventions: (layer norm, attention module, q, k, v, out projection names, second
# half). `_match` returns the convention's name when a layer has that structure, with any
# module at the projections' names: `_check_layer` refuses, by name, those that are not
# nn.Linear's forward (a peft LoRA layer wraps its nn.Linear and is none), where a match
# of nn.Linear only would leave such a layer stock without a word.
_CONVENTIONS = {
    "clip": dict(norm="layer_norm1", attn="self_attn",
                 proj=("q_proj", "k_proj", "v_proj", "out_proj"),
                 rest=("layer_norm2", "mlp")),
    "molmo": dict(norm="attention_norm", attn="attention", proj=("wq", "wk", "wv", "wo"),
                  rest=("ffn_norm", "feed_forward")),
}


def _match(layer):
    for kind, conv in _CONVENTIONS.items():
        attn = getattr(layer, conv["attn"], None)
        if (_layer_norm(layer, conv["norm"]) is not None and isinstance(attn, nn.Module)
                and all(isinstance(getattr(attn, p, None), nn.Module)
                        for p in conv["proj"])
                and all(isinstance(getattr(layer, r, None), nn.Module)
                        for r in conv["rest"])):
            return kind
    return None


def _check_layer(name, layer, kind):
    """Refuse, at the swap, a layer our block would compute differently."""
    conv = _CONVENTIONS[kind]
    norm, attn = getattr(layer, conv["norm"]), getattr(layer, conv["attn"])
    q, k, v, o = (getattr(attn, p) for p in conv["proj"])
    # a registered layer class is the user's word for both its forward and its attention
    if kind == "clip" and not _common.stock_forward_is(type(layer), _REGISTERED_LAYERS):
        if not _runs_clips_forward(type(layer)):
            raise ValueError(
                f"{name}: {type(layer).__name__}.forward is not CLIPEncoderLayer's (x + "
                "attention(layer_norm1(x)), then x + mlp(layer_norm2(x))), so the fused "
                "layer would leave out what it computes besides; if its math is exactly "
                "that, declare it with "
                "vitattn_bwd.integrations.hf.register_classes(layer=...)")
        if not _runs_transformers_attention(type(attn)):
            raise ValueError(
                f"{name}: {conv['attn']} is {_common.qualified_name(type(attn))}, "
                "whose forward is not transformers' own: the fused layer reads its "
                "projections and never calls it, so what it computes besides would be "
                "left out; if its math is plain softmax attention, declare the layer "
                "class with vitattn_bwd.integrations.hf.register_classes(layer=...)")
    extra = [child for child, module in attn.named_children()
             if child not in conv["proj"] and not isinstance(module, nn.Dropout)]
    if extra:
        raise ValueError(f"{name}: {conv['attn']} has submodules the fused block would not "
                         f"run: {extra} (only the q/k/v/out projections are read)")
    _common.check_not_hooked(name, layer, {conv["norm"]: norm, conv["attn"]: attn},
                             library_hook=_is_output_capture_hook)
    for attr, module, stock in _projections(attn, conv):
        _common.check_stock_forward(name, module, attr, stock)
    E = q.in_features
    _common.check_layer_norm(name, norm, conv["norm"], E)
    for lin in (q, k, v, o):
        if (lin.in_features, lin.out_features) != (E, E):
            raise ValueError(f"{name}: projections must be {E} -> {E} (no grouped-query "
                             f"or differently sized heads), got {lin}")
    num_heads = getattr(attn, "num_heads", None)
    if num_heads is None:
        raise ValueError(f"{name}: {conv['attn']} has no num_heads attribute")
    kv_heads = getattr(attn, "num_key_value_heads", num_heads)
    if kv_heads != num_heads:
        raise ValueError(f"{name}: grouped-query attention ({kv_heads} key/value heads "
                         f"for {num_heads} heads) is not supported")
    check_config(E, num_heads, norm.eps)
    refusal = _attention_refusal(attn, E // num_heads, training=True)
    if refusal:
        raise ValueError(f"{name}: {refusal}")
    if getattr(attn, "is_causal", False):
        raise ValueError(f"{name}: causal attention is not supported")
    if kind == "molmo":
        for scale in _LAYER_SCALES:
            _check_layer_scale(name, layer, scale, E)
        if not _common.stock_forward_is(type(layer), _REGISTERED_LAYERS):
            _check_molmo_math(name, layer, num_heads)
    return num_heads


# A Molmo-style layer's per-channel layer scales (DinoResidualAttentionBlock's), each
# optional: on the attention half's output, then on the feed-forward half's.
_LAYER_SCALES = ("lambda1", "lambda2")


def _check_layer_scale(name, layer, scale, E):
    """A Molmo-style layer's `scale` attribute is absent or a floating [E] tensor."""
    value = getattr(layer, scale, None)
    if value is None:
        return
    if (not isinstance(value, torch.Tensor) or not value.is_floating_point()
            or tuple(value.shape) != (E,)):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}: {scale} must be a floating tensor of shape ({E},) (a "
                         f"per-channel layer scale), got {got}")


# Molmo-style layers are matched by their submodules' names, which other models share
# (Llama-style blocks with a LayerNorm, causal or rotary attention), and their code
# (remote code, several versions) has no reference in transformers to compare with. So
# the swap runs a CPU copy of the layer, with random parameters, on random tokens against
# what the swapped layer computes; a difference above this fraction of the output's
# largest value refuses the layer. Float32 rounding leaves < 1e-6 (Molmo's einsum
# attention against SDPA: 7.6e-7); a causal mask or a post-norm block 0.2-5.
MOLMO_PROBE_TOLERANCE = 1e-4
_MOLMO_MATH = ("x + attention(attention_norm(x)) [* lambda1], then x + "
               "feed_forward(ffn_norm(x)) [* lambda2], with plain softmax attention of "
               "its wq / wk / wv / wo projections")


def _check_molmo_math(name, layer, num_heads):
    """Refuse, naming the layer, a Molmo-style layer that does not compute _MOLMO_MATH
    (each layer scale where the layer has it), or whose computation cannot be checked:
    a submodule besides those four (which the swapped layer would not run), a layer
    that cannot be copied (one sharded by FSDP2), or one whose copy fails on random
    tokens."""
    cls = type(layer).__name__
    register = (f"; if it computes exactly {_MOLMO_MATH}, declare its class with "
                "vitattn_bwd.integrations.hf.register_classes(layer=...)")
    conv = _CONVENTIONS["molmo"]
    children = [conv["norm"], conv["attn"], *conv["rest"]]
    extra = [child for child, _ in layer.named_children() if child not in children]
    if extra:
        raise ValueError(f"{name}: {cls} has submodules the fused layer would not run: "
                         f"{extra} (it runs {children})" + register)
    try:
        probe = _random_cpu_copy(layer)
    except Exception as error:
        raise ValueError(f"{name}: {cls} could not be copied to check what it computes "
                         f"({error!r}); swap before sharding the model (FSDP2's "
                         "fully_shard)" + register) from error
    try:
        want, got = _molmo_probe(probe, num_heads)
    except Exception as error:
        raise ValueError(f"{name}: a CPU copy of {cls} failed on random tokens ({error!r}), "
                         "so what it computes could not be checked" + register) from error
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        raise ValueError(f"{name}: {cls}.forward returns "
                         f"{tuple(want.shape) if isinstance(want, torch.Tensor) else type(want)}"
                         f" for an input of shape {tuple(got.shape)}, where the swapped layer "
                         "returns the input's shape" + register)
    difference = ((want - got).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not difference <= MOLMO_PROBE_TOLERANCE:           # NaN refuses too
        raise ValueError(
            f"{name}: {cls} does not compute {_MOLMO_MATH}: on random tokens its output "
            f"differs from that by {difference:.1e} of its largest value (a mask, rotary "
            "embeddings or other terms the fused layer would leave out); if its math is "
            "exactly that, declare its class with "
            "vitattn_bwd.integrations.hf.register_classes(layer=...)")


def _random_cpu_copy(layer):
    """A float32 CPU copy of `layer` in eval mode whose parameters are seeded random
    values (~1/sqrt(fan-in) for matrices) and whose buffers are the layer's own (zeros
    for those on the meta device); forward hooks removed. The layer's parameters are
    not copied (deepcopy with a memo), so a layer on a GPU takes no GPU memory."""
    generator = torch.Generator().manual_seed(0)
    memo = {}
    for p in layer.parameters():
        fan_in = p.shape[-1] if p.dim() > 1 else 4
        value = torch.randn(p.shape, generator=generator, dtype=torch.float32,
                            device="cpu") / math.sqrt(fan_in)
        memo[id(p)] = nn.Parameter(value, requires_grad=False)
    for b in layer.buffers():
        dtype = torch.float32 if b.is_floating_point() else b.dtype
        memo[id(b)] = (torch.zeros(b.shape, dtype=dtype, device="cpu") if b.is_meta
                       else b.detach().to("cpu", dtype, copy=True))
    probe = copy.deepcopy(layer, memo).eval()
    for module in probe.modules():
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
    return probe


def _molmo_probe(probe, num_heads):
    """(probe's forward on random tokens x [2,5,E], the swapped layer's math on x:
    module.stock_forward of its attention_norm and projections with lambda1 as its
    LayerScale, then x + feed_forward(ffn_norm(x)) * lambda2, each scale where the layer
    has it), on the CPU without autocast. Hooks registered for every module
    (torch.nn.modules.module.register_module_forward_hook) still fire."""
    conv = _CONVENTIONS["molmo"]
    norm, attn = getattr(probe, conv["norm"]), getattr(probe, conv["attn"])
    q, k, v, o = (getattr(attn, p) for p in conv["proj"])
    E = q.in_features
    with torch.device("cpu"), torch.no_grad(), torch.autocast("cpu", enabled=False):
        x = torch.randn(2, 5, E, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float32)
        want = probe.forward(x)
        lambda1, lambda2 = (getattr(probe, scale, None) for scale in _LAYER_SCALES)
        h = stock_forward(x, *_common.block_parameters(norm, *_qkv(q, k, v), o.weight,
                                                       o.bias),
                          num_heads, norm.eps, gamma=lambda1)
        got = h + _scaled(probe.feed_forward(probe.ffn_norm(h)), lambda2)
    return want, got


def _scaled(y, scale):
    """y times a per-channel layer scale, or y where there is none."""
    return y if scale is None else y * scale


def _is_output_capture_hook(hook):
    """Whether a forward hook is one of transformers 5's output-capture hooks, which it
    installs on `self_attn` at a model's first call that asks for hidden states or
    attention maps (with those of every layer): inactive unless attention maps are
    asked for, which the swapped layer refuses at the call (_attentions_requested)."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def _attention_refusal(attn, head_dim, training):
    """Why our block would not compute an attention module's settings, else None: a
    scale other than 1/sqrt(head_dim), or attention dropout > 0 where it applies (in
    training; at the swap, always). Checked at the swap and again at every call of a
    swapped layer, so that a setting changed after the swap is refused too, not
    ignored; the caller names the layer."""
    scale, want = getattr(attn, "scale", None), head_dim ** -0.5
    # a comparison, not math.isclose: under torch.compile(dynamic=True) the scale is a
    # symbolic float, which dynamo cannot pass to math functions
    if scale is not None and abs(scale - want) > 1e-6 * want:
        return f"attention scale {scale} is not 1/sqrt(head_dim) = {want}"
    if not training:
        return None
    dropout = getattr(attn, "dropout", 0.0)
    if isinstance(dropout, nn.Module):                     # an nn.Dropout, or a float
        dropout = dropout.p
    if isinstance(dropout, (int, float)) and dropout > 0:
        return (f"attention dropout {dropout} > 0 is not supported (set the config's "
                "attention_dropout to 0.0 before loading)")
    # nn.Dropout children (Molmo's attention_dropout and residual_dropout)
    for child, module in attn.named_children():
        if isinstance(module, nn.Dropout) and module.p > 0:
            return (f"attention dropout {module.p} > 0 ({child}) is not supported (set it "
                    "to 0.0 before loading: the fused block has no dropout)")
    return None


def _output_collector():
    """transformers 5's output-capture collector (a context variable holding the dict of
    outputs being collected), or None (transformers 4.x passes output_attentions to each
    layer instead)."""
    module = sys.modules.get("transformers.utils.output_capturing")
    return getattr(module, "_active_collector", None)


def _attentions_requested(layer, kwargs):
    """Whether the caller asked for attention maps. transformers 4.x passes
    output_attentions to every layer; transformers 5 may pass it in kwargs, or (from the
    config) only to its output-capture hooks, through a context variable whose dict
    holds an "attentions" list while attention maps are being collected.

    Under torch.compile the context variable is not read: dynamo cannot trace
    ContextVar.get (a graph break). There transformers' CompileableContextVar keeps
    the dict in a plain attribute while compiling (`compiling`, `global_var`), which is
    read where it is set; elsewhere (the capture set outside the traced code) the
    decision is transformers' own rule, output_attentions from kwargs or else from the
    attention module's config."""
    requested = kwargs.get("output_attentions")
    if requested:
        return True
    collector = _output_collector()
    if not torch.compiler.is_compiling():
        collected = collector.get() if collector is not None else None
        return bool(collected) and "attentions" in collected
    if getattr(collector, "compiling", False):
        collected = collector.global_var
        return bool(collected) and "attentions" in collected
    if requested is not None:                 # False given explicitly
        return False
    attn = getattr(layer, _CONVENTIONS["clip"]["attn"], None)
    return bool(getattr(getattr(attn, "config", None), "output_attentions", False))


def _no_attentions(layer):
    raise ValueError(
        f"{_common._who(layer)} cannot return attention maps: output_attentions=True is "
        "not supported. Call vitattn_bwd.integrations.hf.unswap_attention(model) first "
        "to get them from the stock layers.")


def _projections(attn, conv):
    """(attr, module, nn.Linear) of the four projections whose parameters the fused
    block reads in place of their forwards."""
    return tuple((f"{conv['attn']}.{p}", getattr(attn, p), nn.Linear) for p in conv["proj"])


def _qkv(q, k, v):
    """The [3E,E] weight and [3E] bias of the q | k | v projections (a None bias as
    zeros), as the fused block takes them."""
    weight = torch.cat([q.weight, k.weight, v.weight], dim=0)
    bias = torch.cat([lin.bias if lin.bias is not None else q.weight.new_zeros(q.out_features)
                      for lin in (q, k, v)])
    return weight, bias


def _attention_half(layer, hidden_states, conv, num_heads, gamma=None):
    norm, attn = getattr(layer, conv["norm"]), getattr(layer, conv["attn"])
    q, k, v, o = (getattr(attn, p) for p in conv["proj"])
    if any(type(lin).forward is not nn.Linear.forward for lin in (q, k, v, o)):
        _common.refuse_replaced(layer, _projections(attn, conv))     # replaced since
    refusal = _attention_refusal(attn, q.in_features // num_heads, layer.training)
    if refusal:                        # the layer's name is made only to refuse
        raise ValueError(f"{_common._who(layer)}: {refusal}")
    return _common.fused_attention(hidden_states, norm, *_qkv(q, k, v), o.weight, o.bias,
                                   num_heads, gamma=gamma,
                                   precision=_common.precision_of(layer))


def _clip_forward(self, hidden_states, *args, **kwargs):
    """CLIP / SigLIP layer: the fused attention half, then the stock MLP half."""
    if self._vitattn_legacy:             # transformers 4.x: explicit arguments, a tuple
        # by name, as the stock signature binds them (a dict from a zip, which dynamo
        # traces, where inspect.Signature.bind is not traceable)
        names = self._vitattn_positional
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}.forward takes {len(names) + 1} "
                            f"positional arguments, got {len(args) + 1}")
        arguments = dict(zip(names, args))
        arguments.update(kwargs)
    else:                                # transformers 5 style: (hidden, mask, **kwargs)
        if len(args) > 1:
            raise ValueError(f"{_common._who(self)} takes hidden_states and an attention "
                             f"mask by position, got {len(args) + 1} positional arguments: "
                             "what the others compute (rotary position embeddings, say) "
                             "the fused block does not")
        arguments = dict(kwargs)
        if args:
            arguments["attention_mask"] = args[0]
    unknown = sorted(name for name, value in arguments.items()
                     if value is not None and name not in _LAYER_ARGUMENTS)
    if unknown:
        raise ValueError(f"{_common._who(self)} does not support {unknown}: the fused block "
                         "would leave out what they compute (rotary position embeddings, "
                         "packed sequences' boundaries, ...)")
    for mask in ("attention_mask", "causal_attention_mask"):
        if arguments.get(mask) is not None:
            _common.refuse_mask(self, mask)
    if _attentions_requested(self, arguments):
        _no_attentions(self)
    conv = _CONVENTIONS["clip"]
    hidden_states = _attention_half(self, hidden_states, conv, self._vitattn_num_heads)
    residual = hidden_states
    hidden_states = residual + self.mlp(self.layer_norm2(hidden_states))
    return (hidden_states,) if self._vitattn_legacy else hidden_states


def _molmo_forward(self, x, *args, **kwargs):
    """Molmo ResidualAttentionBlock: x + attention(norm(x)), then the stock FFN half;
    DinoResidualAttentionBlock: the same with lambda1 folded into the fused half's out
    projection and lambda2 on the FFN half's output."""
    if args or any(v is not None for v in kwargs.values()):
        _common.refuse_mask(self, "extra forward arguments (a mask)")
    lambda1, lambda2 = (getattr(self, scale, None) for scale in _LAYER_SCALES)
    x = _attention_half(self, x, _CONVENTIONS["molmo"], self._vitattn_num_heads, lambda1)
    return x + _scaled(self.feed_forward(self.ffn_norm(x)), lambda2)


def _fused_class(stock_cls, kind):
    signature = inspect.signature(stock_cls.forward)
    legacy = kind == "clip" and "output_attentions" in signature.parameters
    positional = [name for name, p in list(signature.parameters.items())[2:]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return _common.make_fused_class(
        stock_cls, kind, _clip_forward if kind == "clip" else _molmo_forward, globals(),
        _FUSED_CLASSES, "Hugging Face",
        dict(_vitattn_legacy=legacy,
             _vitattn_positional=tuple(positional)))    # after self, hidden_states


LOOKED_FOR = ("layer_norm1 + self_attn.q_proj/k_proj/v_proj/out_proj + layer_norm2 + "
              "mlp, or attention_norm + attention.wq/wk/wv/wo + ffn_norm + feed_forward")


def swap_attention(model, *, vision_only=True, precision=None):
    """Run the attention half of every matching encoder layer of `model` (in place) with
    vitattn_bwd's fused block; return `model`. `vision_only=False` also swaps layers
    outside modules named *Vision* (e.g. a bare encoder). `precision` as
    VisionAttentionBlock's (vitattn_bwd.module). Raises ValueError if no layer matches or
    a matching layer cannot be computed exactly (dropout, grouped-query, non-standard
    scale), or for an unknown precision; nothing is swapped then."""
    return _common.swap(model, [sys.modules[__name__]], vision_only, LOOKED_FOR,
                        precision, what="encoder layer")


def unswap_attention(model):
    """Restore the stock class of every swapped layer of `model` (any integration's);
    return `model`."""
    return _common.unswap(model)
