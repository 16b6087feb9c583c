"""Integrations with model libraries: one entry point that swaps the attention half of
every vision-transformer layer it recognizes for vitattn_bwd's fused block.

    from vitattn_bwd.integrations import swap_attention, unswap_attention

    swap_attention(model)      # in place; returns the model
    unswap_attention(model)    # the stock classes back

Each layer is recognized by its library's convention and handled by that library's
module: Hugging Face CLIP / SigLIP and Molmo-style layers (`hf`), timm's
vision_transformer.Block (`timm`), OpenCLIP's ResidualAttentionBlock (`open_clip`); see
each module's docstring for what it matches and refuses. A swapped layer keeps its
submodules, parameters and state_dict keys, and stays an instance of its own class (it
gets a subclass whose forward runs the attention half as
vitattn_bwd.module.vision_attention). A layer that matches but cannot be computed exactly
raises ValueError naming the layer and the reason, and then nothing is swapped. Inside
torch.compile(model) a swapped model compiles without graph breaks (fullgraph=True too):
a float32 block's forward and backward are opaque operators of the graph
(vitattn_bwd.block_ops), and under autocast the block is the stock ops (so is a float32
training step of one or two images at torch's "high": vitattn_bwd.routing).

None of the libraries is imported here or by the submodules: importing vitattn_bwd never
requires them (timm and OpenCLIP classes are looked up among the imported modules).
"""
from . import _common
from . import hf as _hf
from . import open_clip as _open_clip
from . import timm as _timm

__all__ = ["swap_attention", "unswap_attention", "swapped_layers", "is_swapped",
           "LIBRARIES"]

LIBRARIES = {"hf": _hf, "timm": _timm, "open_clip": _open_clip}
is_swapped = _common.is_swapped
swapped_layers = _common.swapped_layers

_LOOKED_FOR = {
    "hf": "Hugging Face CLIP/SigLIP layers (layer_norm1 + self_attn.q_proj/k_proj/v_proj/"
          "out_proj + layer_norm2 + mlp) or Molmo-style ones (attention_norm + "
          "attention.wq/wk/wv/wo + ffn_norm + feed_forward)",
    "timm": _timm.LOOKED_FOR,
    "open_clip": _open_clip.LOOKED_FOR,
}


def swap_attention(model, *, vision_only=True, libraries=None, precision=None):
    """Run the attention half of every recognized layer of `model` (in place) with
    vitattn_bwd's fused block; return `model`.

    libraries: a name or names from LIBRARIES to look for (default: all). vision_only
    (default True): only layers inside a module whose class name contains "Vision" (a
    CLIP model's vision tower, timm's VisionTransformer), so text towers stay stock;
    False swaps every recognized layer (a bare encoder or list of blocks). precision: as
    VisionAttentionBlock's (None: the stock ops under torch.autocast and for an
    all-bf16/fp16 model, else the fused path at torch's float32 matmul precision;
    "medium" our one-product path; "highest" or "high" keeps the fused float32-grade
    path everywhere; vitattn_bwd.module). Raises ValueError if
    no layer is recognized or a recognized one cannot be computed exactly (the message
    names the layer and why), for an unknown precision, or for a precision other than
    that of layers swapped already (unswap_attention first), and TypeError if `model`
    is not a torch.nn.Module; nothing is swapped then."""
    names = (list(LIBRARIES) if libraries is None else
             [libraries] if isinstance(libraries, str) else list(libraries))
    unknown = [n for n in names if n not in LIBRARIES]
    if unknown:
        raise ValueError(f"unknown libraries {unknown}; choose from {list(LIBRARIES)}")
    looked_for = "; or ".join(_LOOKED_FOR[n] for n in names)
    return _common.swap(model, [LIBRARIES[n] for n in names], vision_only, looked_for,
                        precision)


def unswap_attention(model):
    """Restore the stock class of every swapped layer of `model`, whichever integration
    swapped it; return `model`."""
    return _common.unswap(model)
