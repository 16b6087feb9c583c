"""The public backward: argument checks, then the compiled graph (graph.py)."""
import functools
import math
import numbers
import operator
from typing import NamedTuple

import torch

from .graph import check_faithful_batch, compiled_backward
from .layout import LN_GRAD_MODES
from .precision import check_fused_precision


class BlockGrads(NamedTuple):
    grad_x: torch.Tensor            # [B,S,E]
    grad_qkv_weight: torch.Tensor   # [3E,E]
    grad_qkv_bias: torch.Tensor     # [3E]
    grad_out_weight: torch.Tensor   # [E,E]
    grad_out_bias: torch.Tensor     # [E]
    grad_ln_weight: torch.Tensor    # [E]
    grad_ln_bias: torch.Tensor      # [E]


# name -> expected shape, in terms of B, S, E, H, D
TENSOR_SHAPES = {
    "grad_output": ("B", "S", "E"),
    "x": ("B", "S", "E"),
    "x_mean": ("B", "S", 1),
    "x_var": ("B", "S", 1),
    "x_norm": ("B", "S", "E"),
    "ln_weight": ("E",),
    "qkv_weight": ("3E", "E"),
    "q": ("B", "H", "S", "D"),
    "k": ("B", "H", "S", "D"),
    "v": ("B", "H", "S", "D"),
    "attn_weights": ("B", "H", "S", "S"),
    "attn_output": ("B", "S", "E"),
    "out_weight": ("E", "E"),
}


def _shapes_of(B, S, E, H):
    """name -> expected shape tuple."""
    dims = {"B": B, "S": S, "E": E, "3E": 3 * E, "H": H, "D": E // H}
    return {name: tuple(dims[d] if isinstance(d, str) else d for d in shape)
            for name, shape in TENSOR_SHAPES.items()}


_cached_shapes = functools.lru_cache(maxsize=256)(_shapes_of)


def _expected_shapes(B, S, E, H):
    """Cached in eager calls (the checks run on every call); computed afresh when dynamo
    traces the call (a model under torch.compile), which would bypass the cache anyway."""
    if torch.compiler.is_compiling():
        return _shapes_of(B, S, E, H)
    return _cached_shapes(B, S, E, H)


def _heads_hint(name, t, dims):
    """Why a [B,H,S,D]-shaped input's shape was wrong, when num_heads is the likely cause."""
    if t.dim() != 4:
        return ""
    if name != "attn_weights" and t.shape[1] != dims["H"] and t.shape[1] * t.shape[3] == dims["E"]:
        return (f"; it has {t.shape[1]} heads of {t.shape[3]}: pass num_heads={t.shape[1]}"
                f" (num_heads is {dims['H']}; its default is 16)")
    return f" (num_heads={dims['H']})"


def check_num_heads(num_heads):
    """num_heads as a Python int: ints and NumPy integers (anything with __index__ but
    bool and tensors); TypeError/ValueError naming it otherwise."""
    if type(num_heads) is not int:
        if isinstance(num_heads, (bool, torch.Tensor)):
            raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
        try:
            num_heads = operator.index(num_heads)
        except TypeError:
            raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}") \
                from None
    if num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    return num_heads


def check_float(name, value):
    """A finite Python float from a float, int or NumPy float/int scalar; bool, tensors and
    strings raise a TypeError naming the argument, NaN/Inf a ValueError."""
    if type(value) is not float:
        if isinstance(value, (bool, str, bytes, torch.Tensor)) \
                or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a Python or NumPy float, "
                            f"got {type(value).__name__}")
        value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def validate_inputs(tensors, scale, norm_eps, num_heads, ln_grad, check_finite=False):
    """Raise TypeError/ValueError naming the offending argument; return the tensors made
    contiguous (a copy only where an input was not) and detached, and scale, norm_eps and
    num_heads as Python float, float, int."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ln_grad not in LN_GRAD_MODES:
        raise ValueError(f"ln_grad must be one of {LN_GRAD_MODES}, got {ln_grad!r}")
    num_heads = check_num_heads(num_heads)
    scale = check_float("scale", scale)
    norm_eps = check_float("norm_eps", norm_eps)
    if norm_eps < 0:
        raise ValueError(f"norm_eps must be >= 0, got {norm_eps}")

    x = tensors["x"]
    device, dtype = x.device, x.dtype
    allowed = (torch.float32,) if device.type == "cuda" else (torch.float32, torch.float64)
    if dtype not in allowed:
        raise TypeError(f"x must be one of {allowed} on {device.type}, got {dtype}")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, S, E], got shape {tuple(x.shape)}")
    B, S, E = x.shape
    if E % num_heads:
        raise ValueError(f"x's embed dim {E} is not divisible by num_heads={num_heads}")
    if min(B, S) < 1:
        raise ValueError(f"x must have batch and sequence length >= 1, got {tuple(x.shape)}")

    checked = {}
    shapes = _expected_shapes(B, S, E, num_heads)
    for name, t in tensors.items():
        want = shapes[name]
        if t.shape != want:
            dims = {"E": E, "H": num_heads}
            hint = _heads_hint(name, t, dims) if "H" in TENSOR_SHAPES[name] else ""
            raise ValueError(f"{name} must have shape {want} "
                             f"({'x'.join(map(str, TENSOR_SHAPES[name]))}), "
                             f"got {tuple(t.shape)}{hint}")
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, but x has {dtype}; all inputs "
                            "must share one dtype")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, but x is on {device}; all inputs "
                             "must be on one device")
        if check_finite and not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or Inf")
        checked[name] = t.detach().contiguous()
    return checked, scale, norm_eps, num_heads


def attention_block_backward(grad_output, x, x_mean, x_var, x_norm, ln_weight, qkv_weight,
                             q, k, v, attn_weights, attn_output, out_weight, scale, norm_eps,
                             *, num_heads=16, ln_grad="exact", check_finite=False,
                             precision="high"):
    """Backward of a pre-LayerNorm ViT attention block (see README for the forward).

    Shapes: grad_output, x, x_norm, attn_output [B,S,E]; x_mean, x_var [B,S,1] (biased
    variance); ln_weight [E]; qkv_weight [3E,E]; q, k, v [B,H,S,D] (head-major);
    attn_weights [B,H,S,S] (softmax output); out_weight [E,E]. float32 (float64 on CPU).
    Non-contiguous inputs are copied once. Inputs are never modified.

    ln_grad="exact" is the true LayerNorm gradient; "contract" is the benchmark's formula.
    NaN/Inf inputs propagate to the outputs like in the eager math; check_finite=True
    rejects them with a ValueError instead (one extra pass over every input).
    precision: "high" (the default, whatever torch's float32 matmul precision: the
    fastest products the benchmark's tolerance allows) or "highest" (float32-faithful:
    every product fp16x3, the GEMMs with two-level accumulation, split_gemm.py; batch *
    tokens * 2 * embed_dim below 2^31); on the CPU the products are plain matmuls either
    way.
    """
    check_fused_precision(precision)
    tensors = dict(grad_output=grad_output, x=x, x_mean=x_mean, x_var=x_var, x_norm=x_norm,
                   ln_weight=ln_weight, qkv_weight=qkv_weight, q=q, k=k, v=v,
                   attn_weights=attn_weights, attn_output=attn_output, out_weight=out_weight)
    inputs, scale, norm_eps, _ = validate_inputs(tensors, scale, norm_eps, num_heads, ln_grad,
                                                 check_finite)
    check_faithful_batch(x, precision)
    return BlockGrads(*compiled_backward(inputs, scale=scale, norm_eps=norm_eps,
                                         ln_grad=ln_grad, precision=precision))
