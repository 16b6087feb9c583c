"""Swap the attention half of timm vision transformers for vitattn_bwd's fused block.

    import timm
    from vitattn_bwd.integrations import swap_attention

    model = timm.create_model("vit_large_patch14_clip_336", pretrained=True)
    swap_attention(model)          # in place; returns the model

Matched: every `timm.models.vision_transformer.Block` (or a subclass that keeps its
forward), whose forward is
    x = x + drop_path1(ls1(attn(norm1(x))))
    x = x + drop_path2(ls2(mlp(norm2(x))))
with `attn` timm's `Attention` (fused `qkv` Linear [3E,E], `proj` Linear [E,E],
`num_heads`). The swapped forward runs the first line as
`vitattn_bwd.module.vision_attention` (the fused backward, float32-grade, or at
precision "medium" one product per matmul; at precision None the stock ops under
autocast and for an all-bf16/fp16 model, where they were the faster: vitattn_bwd.routing) and the second with the stock modules.
LayerScale `ls1` is supported exactly: vision_attention folds its gamma into the out
projection on the fused path (x + gamma * (o W^T + b) = x + o (gamma[:, None] W)^T +
gamma b) and multiplies the projection's output by it on the stock path, so gamma gets
its gradient through autograd. A qkv without bias (timm's qkv_bias=False) or a LayerNorm
without affine parameters uses zeros / ones.

The layer keeps its submodules and parameters (state_dict keys, `pretrained=` weights,
checkpoints and optimizers unchanged) and gets a subclass of its own class, so timm's
isinstance checks, `set_grad_checkpointing` and `forward_intermediates` still see a
Block. `unswap_attention` restores the stock class.

Refused at the swap (ValueError naming the layer and the reason): q_norm/k_norm that are
not Identity (qk-norm), a post-attention `norm` (scale_norm) or a gate, an attention
class other than timm's Attention (DiffAttention, ...), an attention width or out width
other than embed_dim (attn_head_dim, dim_out), a non-standard scale, a norm1 that is not
a LayerNorm, an ls1 / drop_path1 of another kind, dims the fused block cannot take, and
a forward overridden on the instance (accelerate's device_map hooks) or forward or
backward hooks on the bypassed submodules (norm1, attn, ls1, drop_path1 and any module
under them). Refused at
the call: an attention mask or is_causal=True, and in training mode attention dropout,
projection dropout or DropPath with a probability > 0 (all three are no-ops in eval).

timm is never imported here: its classes are looked up in sys.modules (a model made of
them has imported them). `register_classes` declares classes with the same layout and
forward math (a vendored copy of timm's ViT; the CPU tests' stand-ins).
"""
import sys

from torch import nn

from . import _common

__all__ = ["swap_attention", "unswap_attention", "swapped_layers", "is_swapped",
           "register_classes"]

_CLASSES = _common.ClassRegistry("timm.models.vision_transformer", dict(
    block=("Block",), attention=("Attention",), layer_scale=("LayerScale",),
    drop_path=("DropPath",), norm=("LayerNorm", "LayerNormFp32")))
is_swapped = _common.is_swapped
swapped_layers = _common.swapped_layers


def register_classes(*, block=(), attention=(), layer_scale=(), drop_path=()):
    """Declare classes that have exactly the layout and forward math of timm's Block,
    Attention, LayerScale and DropPath (as the module docstring writes them), so that
    swap_attention matches them. For vendored copies of timm's ViT code; classes that
    compute anything else must not be registered."""
    _CLASSES.register(block=block, attention=attention, layer_scale=layer_scale,
                      drop_path=drop_path)


def _match(layer):
    known_blocks = _CLASSES.known("block")
    return "block" if _common.stock_forward_is(type(layer), known_blocks) else None


def _check_layer(path, layer, kind):
    """Refuse, at the swap, a Block our fused block would compute differently; return
    its num_heads."""
    norm, attn = getattr(layer, "norm1", None), getattr(layer, "attn", None)
    ls, drop_path = getattr(layer, "ls1", None), getattr(layer, "drop_path1", None)
    if not isinstance(attn, nn.Module) or not _common.stock_forward_is(
            type(attn), _CLASSES.known("attention")):
        raise ValueError(f"{path}: attn is {type(attn).__name__}, not timm's Attention "
                         "(the fused block computes plain softmax attention)")
    qkv, proj = getattr(attn, "qkv", None), getattr(attn, "proj", None)
    if not isinstance(qkv, nn.Linear):
        raise ValueError(f"{path}: attn.qkv is {type(qkv).__name__}, not an nn.Linear")
    E = qkv.in_features
    _common.check_layer_norm(path, norm, "norm1", E, _CLASSES.known("norm"))
    _common.check_linear(path, qkv, "attn.qkv", E, 3 * E,
                         " (an attention width other than embed_dim, or grouped-query "
                         "attention)")
    _common.check_linear(path, proj, "attn.proj", E, E)
    for attr in ("q_norm", "k_norm"):
        if not isinstance(getattr(attn, attr, None), nn.Identity):
            raise ValueError(f"{path}: attn.{attr} is {type(getattr(attn, attr, None)).__name__}"
                             ": qk-norm is not supported (the fused block has none)")
    if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity):
        raise ValueError(f"{path}: attn.norm is {type(attn.norm).__name__}: a norm of the "
                         "attention output (scale_norm) is not supported")
    if getattr(attn, "gate", None) is not None:
        raise ValueError(f"{path}: attn.gate is set: gated attention is not supported")
    num_heads = _common.check_attention_heads(path, attn, E, norm.eps)
    _common.check_layer_scale(path, ls, "ls1", E, _CLASSES.known("layer_scale"), "timm")
    if not isinstance(drop_path, nn.Identity) and not _common.stock_forward_is(
            type(drop_path), _CLASSES.known("drop_path")):
        raise ValueError(f"{path}: drop_path1 is {type(drop_path).__name__}, neither "
                         "Identity nor timm's DropPath")
    _common.check_not_hooked(path, layer, {"norm1": norm, "attn": attn, "ls1": ls,
                                           "drop_path1": drop_path})
    return num_heads


def _check_dropout(layer):
    """What only the call can tell: dropout that is active, by the training flag of the
    module whose flag stock reads (attn_drop: Attention's own in its fused path, the
    dropout module's otherwise; proj_drop and drop_path1: their own), so a layer in
    eval mode with its dropouts in training mode (MC dropout) is refused too."""
    attn = layer.attn
    attn_drop = getattr(attn, "attn_drop", None)
    p = _common.dropout_p(attn_drop)
    if p > 0 and (attn.training or attn_drop.training):
        _common.refuse_in_training(layer, "attn.attn_drop.p", p)
    proj_drop = getattr(attn, "proj_drop", None)
    p = _common.dropout_p(proj_drop)
    if p > 0 and proj_drop.training:
        _common.refuse_in_training(layer, "attn.proj_drop.p", p)
    p = float(getattr(layer.drop_path1, "drop_prob", 0.0) or 0.0)
    if p > 0 and layer.drop_path1.training:
        _common.refuse_in_training(layer, "drop_path1.drop_prob", round(p, 6))


def _block_forward(self, x, attn_mask=None, is_causal=False):
    """timm Block: the fused attention half (LayerScale folded in), then the stock MLP
    half."""
    if attn_mask is not None:
        _common.refuse_mask(self, "attn_mask")
    if is_causal:
        _common.refuse_mask(self, "is_causal=True (causal attention)")
    _check_dropout(self)
    attn, ls = self.attn, self.ls1
    _common.refuse_replaced(self, (("attn.qkv", attn.qkv, nn.Linear),
                                   ("attn.proj", attn.proj, nn.Linear)))
    gamma = None if isinstance(ls, nn.Identity) else ls.gamma
    x = _common.fused_attention(x, self.norm1, attn.qkv.weight, attn.qkv.bias,
                                attn.proj.weight, attn.proj.bias, self._vitattn_num_heads,
                                gamma, _common.precision_of(self))
    return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


_fused_class = _common.one_forward_fused_class(globals(), _block_forward, "timm")


LOOKED_FOR = ("timm Blocks (norm1 + attn.qkv/proj + ls1 + drop_path1 + norm2 + mlp of "
              "timm.models.vision_transformer.Block)")


def swap_attention(model, *, vision_only=True, precision=None):
    """Run the attention half of every timm Block of `model` (in place) with vitattn_bwd's
    fused block; return `model`. `vision_only=False` also swaps Blocks outside modules
    whose class name contains "Vision" (a bare Block or nn.Sequential of them). Raises
    ValueError if none matches or a matching one cannot be computed exactly, or for an
    unknown precision (as VisionAttentionBlock's: vitattn_bwd.module); nothing is
    swapped then."""
    return _common.swap(model, [sys.modules[__name__]], vision_only, LOOKED_FOR,
                        precision)


def unswap_attention(model):
    """Restore the stock class of every swapped layer of `model`; return `model`."""
    return _common.unswap(model)
