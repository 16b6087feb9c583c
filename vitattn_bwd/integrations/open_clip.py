"""Swap the attention half of OpenCLIP vision transformers for vitattn_bwd's fused block.

    import open_clip
    from vitattn_bwd.integrations import swap_attention

    model, _, preprocess = open_clip.create_model_and_transforms("ViT-L-14-336", ...)
    swap_attention(model)          # in place: model.visual's blocks; the text tower stays

Matched: every `open_clip.transformer.ResidualAttentionBlock` (or a subclass that keeps
its forward), whose forward is
    x = q_x + ls_1(attn(ln_1(q_x)))          # self-attention: k_x = v_x = None
    x = x + ls_2(mlp(ln_2(x)))
with `attn` either an nn.MultiheadAttention (open_clip 2.x-3.x: packed `in_proj_weight`
[3E,E] / `in_proj_bias`, `out_proj`; batch_first True, or False where OpenCLIP's
Transformer passes [S,B,E]) or OpenCLIP's own `Attention` (later versions: the same
parameter names, batch first). The first line runs as
`vitattn_bwd.module.vision_attention` (the fused backward, float32-grade, or at
precision "medium" one product per matmul; at precision None the stock ops under
autocast and for an all-bf16/fp16 model, where they were the faster: vitattn_bwd.routing), the second with the stock modules.
LayerScale `ls_1` is applied exactly (folded into the out projection on the fused path;
its gamma gets its gradient).

The layer keeps its submodules and parameters (state_dict keys, `load_checkpoint`,
pretrained weights and optimizers unchanged) and gets a subclass of its own class;
OpenCLIP's `set_grad_checkpointing` (checkpoint(block, x, None, None, attn_mask)) works.
By default only blocks inside a module whose class name contains "Vision" are swapped, so
a CLIP model's text tower (causal masks) stays stock.

Refused at the swap (ValueError naming the layer and the reason): CustomResidualAttentionBlock
(scaled-cosine attention, qk-norm, head scaling, inner norms), an attention with
scaled-cosine logits, qk-norm, head scale or inner norm, separate k/v dims, bias_k/bias_v
or add_zero_attn, a non-standard scale, an ln_1 that is not a LayerNorm, an ls_1 that is
neither Identity nor OpenCLIP's LayerScale, dims the fused block cannot take, and a forward
overridden on the instance (accelerate's device_map hooks) or forward or backward hooks
on the bypassed submodules (ln_1, attn, ls_1 and any module under them). Refused at the
call: an attn_mask, cross-attention (k_x or v_x given), and in training mode attention
(or output) dropout > 0.

open_clip is never imported here: its classes are looked up in sys.modules.
`register_classes` declares classes with the same layout and forward math.
"""
import sys

from torch import nn

from . import _common

__all__ = ["swap_attention", "unswap_attention", "swapped_layers", "is_swapped",
           "register_classes"]

_CLASSES = _common.ClassRegistry("open_clip.transformer", dict(
    block=("ResidualAttentionBlock",), attention=("Attention",),
    layer_scale=("LayerScale",), refused=("CustomResidualAttentionBlock",),
    norm=("LayerNorm", "LayerNormFp32")))
# The block's methods the swapped forward replaces: its forward, and the attention call
# it makes (attention-editing code, MaskCLIP / SCLIP style, overrides that one).
_BLOCK_METHODS = ("forward", "attention")
is_swapped = _common.is_swapped
swapped_layers = _common.swapped_layers


def register_classes(*, block=(), attention=(), layer_scale=(), refused=()):
    """Declare classes with exactly the layout and forward math of OpenCLIP's
    ResidualAttentionBlock, Attention and LayerScale (see the module docstring), or block
    classes to refuse like CustomResidualAttentionBlock. For vendored copies of
    OpenCLIP's code; classes that compute anything else must not be registered."""
    _CLASSES.register(block=block, attention=attention, layer_scale=layer_scale,
                      refused=refused)


def _match(layer):
    cls = type(layer)
    if _common.stock_forward_is(cls, _CLASSES.known("block"), _BLOCK_METHODS):
        return "block"
    if any(issubclass(cls, k) for k in _CLASSES.known("refused")):
        return "refused"
    return None


def _custom_features(layer):
    attn = getattr(layer, "attn", None)
    found = []
    if getattr(attn, "logit_scale", None) is not None:
        found.append("scaled-cosine attention")
    for attr, what in (("ln_q", "qk-norm"), ("ln_inner", "an inner attention norm")):
        if not isinstance(getattr(attn, attr, nn.Identity()), nn.Identity):
            found.append(what)
    if getattr(attn, "head_scale", None) is not None:
        found.append("head scaling")
    if not isinstance(getattr(layer, "ln_attn", nn.Identity()), nn.Identity):
        found.append("a norm after attention (scale_attn)")
    return found


def _check_mha(path, attn, E):
    if not getattr(attn, "_qkv_same_embed_dim", True) or attn.in_proj_weight is None:
        raise ValueError(f"{path}: attn has separate q/k/v projection weights (kdim/vdim "
                         "other than embed_dim): not supported")
    if attn.bias_k is not None or attn.bias_v is not None:
        raise ValueError(f"{path}: attn has bias_k/bias_v (add_bias_kv=True): not "
                         "supported")
    if attn.add_zero_attn:
        raise ValueError(f"{path}: attn has add_zero_attn=True: not supported")
    if attn.embed_dim != E:
        raise ValueError(f"{path}: attn.embed_dim {attn.embed_dim} is not ln_1's {E}")


def _check_open_clip_attention(path, attn, E):
    if getattr(attn, "in_proj_weight", None) is None:
        raise ValueError(f"{path}: attn has separate q/k/v projection weights (kdim/vdim "
                         "other than embed_dim): not supported")
    if getattr(attn, "logit_scale", None) is not None:
        raise ValueError(f"{path}: attn uses scaled-cosine attention (logit_scale): not "
                         "supported")
    for attr, what in (("ln_q", "qk-norm"), ("ln_k", "qk-norm"),
                       ("ln_inner", "a norm of the attention output (inner_norm)")):
        if not isinstance(getattr(attn, attr, nn.Identity()), nn.Identity):
            raise ValueError(f"{path}: attn.{attr} is "
                             f"{type(getattr(attn, attr)).__name__}: {what} is not "
                             "supported")
    if getattr(attn, "head_scale", None) is not None:
        raise ValueError(f"{path}: attn has head_scale (scale_heads=True): not supported")


def _check_layer(path, layer, kind):
    """Refuse, at the swap, a block our fused block would compute differently; return
    its num_heads."""
    if kind == "refused":
        features = _custom_features(layer)
        raise ValueError(
            f"{path}: {type(layer).__name__} is not supported"
            + (f" (it has {', '.join(features)})" if features else "")
            + ": the fused block computes plain pre-LayerNorm softmax attention; only "
              "ResidualAttentionBlock is swapped. Pass a model without custom blocks, or "
              "keep it stock")
    norm, attn, ls = (getattr(layer, a, None) for a in ("ln_1", "attn", "ls_1"))
    is_mha = isinstance(attn, nn.MultiheadAttention) and \
        type(attn).forward is nn.MultiheadAttention.forward
    if not is_mha and not (isinstance(attn, nn.Module) and _common.stock_forward_is(
            type(attn), _CLASSES.known("attention"))):
        raise ValueError(f"{path}: attn is {type(attn).__name__}, neither "
                         "nn.MultiheadAttention nor OpenCLIP's Attention")
    if not isinstance(norm, nn.LayerNorm):
        raise ValueError(f"{path}: ln_1 is {type(norm).__name__}, not a LayerNorm (the "
                         "fused block normalizes with LayerNorm)")
    E = norm.normalized_shape[-1]
    _common.check_layer_norm(path, norm, "ln_1", E, _CLASSES.known("norm"))
    (_check_mha if is_mha else _check_open_clip_attention)(path, attn, E)
    weight = attn.in_proj_weight
    if tuple(weight.shape) != (3 * E, E):
        raise ValueError(f"{path}: attn.in_proj_weight has shape {tuple(weight.shape)}, "
                         f"not {(3 * E, E)} (grouped-query or differently sized heads)")
    bias = getattr(attn, "in_proj_bias", None)
    if bias is not None and tuple(bias.shape) != (3 * E,):
        raise ValueError(f"{path}: attn.in_proj_bias has shape {tuple(bias.shape)}, not "
                         f"{(3 * E,)}")
    _common.check_linear(path, getattr(attn, "out_proj", None), "attn.out_proj", E, E)
    num_heads = _common.check_attention_heads(path, attn, E, norm.eps)
    _common.check_layer_scale(path, ls, "ls_1", E, _CLASSES.known("layer_scale"),
                              "OpenCLIP")
    _common.check_not_hooked(path, layer, {"ln_1": norm, "attn": attn, "ls_1": ls},
                             methods=_BLOCK_METHODS)
    return num_heads


def _check_dropout(layer):
    """What only the call can tell: dropout that is active, by the training flag of the
    module that applies it (nn.MultiheadAttention's own; OpenCLIP Attention's dropout
    modules'), so a layer in eval mode with its dropouts in training mode (MC dropout)
    is refused too."""
    attn = layer.attn
    if isinstance(attn, nn.MultiheadAttention):
        if attn.training and attn.dropout > 0:
            _common.refuse_in_training(layer, "attn.dropout", attn.dropout)
        return
    for attr in ("attn_drop", "out_drop"):
        module = getattr(attn, attr, None)
        p = _common.dropout_p(module)
        if p > 0 and module.training:
            _common.refuse_in_training(layer, f"attn.{attr}.p", p)


def _block_forward(self, q_x, k_x=None, v_x=None, attn_mask=None):
    """OpenCLIP ResidualAttentionBlock: the fused attention half (LayerScale folded in),
    then the stock MLP half. [B,S,E], or [S,B,E] for a batch_first=False attention."""
    if k_x is not None or v_x is not None:
        _common.refuse_mask(self, "cross-attention (k_x / v_x)")
    if attn_mask is not None:
        _common.refuse_mask(self, "attn_mask")
    _check_dropout(self)
    attn, ls = self.attn, self.ls_1
    _common.refuse_replaced(self, (("attn.out_proj", attn.out_proj, nn.Linear),))
    gamma = None if isinstance(ls, nn.Identity) else ls.gamma
    batch_first = getattr(attn, "batch_first", True)
    x = q_x if batch_first else q_x.transpose(0, 1).contiguous()
    x = _common.fused_attention(x, self.ln_1, attn.in_proj_weight, attn.in_proj_bias,
                                attn.out_proj.weight, attn.out_proj.bias,
                                self._vitattn_num_heads, gamma, _common.precision_of(self))
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    return x + self.ls_2(self.mlp(self.ln_2(x)))


_fused_class = _common.one_forward_fused_class(globals(), _block_forward,
                                                "OpenCLIP")


LOOKED_FOR = ("OpenCLIP ResidualAttentionBlocks (ln_1 + attn (nn.MultiheadAttention or "
              "OpenCLIP's Attention) + ls_1 + ln_2 + mlp + ls_2)")


def swap_attention(model, *, vision_only=True, precision=None):
    """Run the attention half of every OpenCLIP ResidualAttentionBlock of `model` (in
    place) with vitattn_bwd's fused block; return `model`. `vision_only=False` also swaps
    blocks outside modules whose class name contains "Vision" (a text tower's blocks then
    refuse its causal mask at the call). Raises ValueError if none matches or a matching
    one cannot be computed exactly, or for an unknown precision (as VisionAttentionBlock's:
    vitattn_bwd.module); nothing is swapped then."""
    return _common.swap(model, [sys.modules[__name__]], vision_only, LOOKED_FOR,
                        precision)


def unswap_attention(model):
    """Restore the stock class of every swapped layer of `model`; return `model`."""
    return _common.unswap(model)
