"""The checks of every entry point's arguments, in one place and one wording: the
backward alone (attention_block_backward, api.py), the block (vision_attention,
VisionAttentionFunction, VisionAttentionBlock, module.py) and the swapped layers'
configurations (integrations/). Each runs at the call, before any work, and raises a
TypeError (a value of the wrong kind) or a ValueError (a value out of range) whose message
begins with the argument's name. Scalars come back as Python int / float.

Imports only layout.py and precision.py of ours, so every layer may use it."""
import functools
import math
import numbers
import operator

import torch

from .layout import LN_GRAD_MODES
from .precision import FUSED_PRECISIONS, Products

# The accepted values of a block's `precision` (module.py's docstring): None follows
# torch's float32 matmul precision; "medium" is the one-product path.
PRECISIONS = (None, *FUSED_PRECISIONS, "medium")

# Every tensor an entry point takes -> its shape, in the batch B, tokens S, width E,
# heads H and head dim D. The backward takes the first 13, the block x and the next six
# (gamma: a LayerScale's vector).
SHAPES = {
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
    "ln_bias": ("E",),
    "qkv_bias": ("3E",),
    "out_bias": ("E",),
    "gamma": ("E",),
}
# The block's parameters, in vision_attention's order.
BLOCK_PARAMS = ("ln_weight", "ln_bias", "qkv_weight", "qkv_bias", "out_weight", "out_bias")


# --- scalars ---------------------------------------------------------------------------

def check_positive_int(name, value):
    """`value` as a Python int >= 1: ints and NumPy integers (anything with __index__ but
    bool and tensors)."""
    if type(value) is not int:
        if isinstance(value, (bool, torch.Tensor)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} "
                            f"{value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_float(name, value, minimum=None):
    """`value` as a finite Python float (and >= minimum, if given), from a float, int or
    NumPy scalar; bool, tensors, strings and complex numbers are refused."""
    if type(value) is not float:
        if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
        value = float(value)
    # comparisons rather than math.isfinite, which dynamo cannot trace on the symbolic
    # float a module's eps becomes under torch.compile(dynamic=True) (NaN fails both)
    if not -math.inf < value < math.inf or (minimum is not None and value < minimum):
        bounds = "finite" if minimum is None else f"finite and >= {minimum}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def check_one_of(name, value, allowed):
    """`value` if it is one of `allowed`, else ValueError naming them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def check_precision(precision, allowed=PRECISIONS):
    """`precision` if it is one of `allowed` (a block's PRECISIONS; FUSED_PRECISIONS for
    the fused float32 path and the backward alone)."""
    return check_one_of("precision", precision, allowed)


def check_probs_or_lse(caller, probs, lse):
    """Exactly one of the attention probabilities probs (P [B,H,S,S]) and their row
    log-sum-exp lse ([B,H,S]) is given, of that rank (ValueError naming `caller`
    otherwise). Returns whether lse is the one (P is then recomputed)."""
    if (probs is None) == (lse is None):
        raise ValueError(f"{caller}: give exactly one of probs (P [B,H,S,S]) and lse (its "
                         f"row log-sum-exp [B,H,S]), got "
                         f"{'neither' if probs is None else 'both'}")
    given, name, rank = (probs, "probs", 4) if lse is None else (lse, "lse", 3)
    if given.dim() != rank:
        raise ValueError(f"{caller}: {name} must be {rank}-D, got shape "
                         f"{tuple(given.shape)}")
    return lse is not None


def check_heads_divide(embed_dim, num_heads, embed_dim_of=""):
    """ValueError unless num_heads divides embed_dim (`embed_dim_of`: where the width was
    read, for the message)."""
    if embed_dim % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide embed_dim={embed_dim}"
                         + embed_dim_of)


def check_config(embed_dim, num_heads, eps):
    """A block's configuration: (embed_dim, num_heads, eps) as (int, int, float)."""
    embed_dim = check_positive_int("embed_dim", embed_dim)
    num_heads = check_positive_int("num_heads", num_heads)
    check_heads_divide(embed_dim, num_heads)
    return embed_dim, num_heads, check_float("eps", eps, minimum=0)


# --- tensors ---------------------------------------------------------------------------

def supported_dtypes(device):
    """The dtypes of the fused float32 path on `device`: float32, and float64 on the CPU."""
    return (torch.float32,) if device.type == "cuda" else (torch.float32, torch.float64)


def _shapes_of(B, S, E, H):
    dims = {"B": B, "S": S, "E": E, "3E": 3 * E, "H": H, "D": E // H}
    return {name: tuple(dims[d] if isinstance(d, str) else d for d in shape)
            for name, shape in SHAPES.items()}


_cached_shapes = functools.lru_cache(maxsize=256)(_shapes_of)


def expected_shapes(B, S, E, H):
    """name -> the shape SHAPES gives it. Cached in eager calls (the checks run on every
    call); computed afresh when dynamo traces the call (a model under torch.compile),
    which would bypass the cache anyway."""
    if torch.compiler.is_compiling():
        return _shapes_of(B, S, E, H)
    return _cached_shapes(B, S, E, H)


def check_tensor(name, value):
    """TypeError unless `value` is a dense (strided) tensor: a sparse, MKL-DNN or nested
    one would fail deep inside the math with an error that names no argument."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_nested:            # a strided nested tensor reports layout torch.strided
        raise TypeError(f"{name} must be a dense tensor, got a nested tensor; pad it "
                        "(.to_padded_tensor(0.0)) into one")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}; "
                        "pass .to_dense()")


def check_x(x, embed_dim=None):
    """x is a [B, S, E] tensor (E = embed_dim, if given)."""
    check_tensor("x", x)
    if x.dim() != 3 or (embed_dim is not None and x.shape[-1] != embed_dim):
        raise ValueError(f"x must be [B, S, {embed_dim or 'E'}] (batch, tokens, embed_dim), "
                         f"got shape {tuple(x.shape)}")


def check_dtype(x, allowed, hint=""):
    """TypeError unless x's dtype is one of `allowed`."""
    if x.dtype not in allowed:
        raise TypeError(f"x must be one of {allowed} on {x.device.type}, got {x.dtype}{hint}")


def _heads_hint(name, t, E, H):
    """Why a [B,H,S,D]-shaped input's shape was wrong, when num_heads is the likely cause."""
    if "H" not in SHAPES[name] or t.dim() != 4:
        return ""
    if name != "attn_weights" and t.shape[1] != H and t.shape[1] * t.shape[3] == E:
        return (f"; it has {t.shape[1]} heads of {t.shape[3]}: pass num_heads={t.shape[1]}"
                f" (num_heads is {H}; its default is 16)")
    return f" (num_heads={H})"


def _dtype_mismatch(name, t, x):
    return TypeError(f"{name} has dtype {t.dtype}, but x has {x.dtype}; all inputs must "
                     "share one dtype")


def _unlike_x(tensors, x, name, attribute):
    """The error for tensors[name], whose dtype or device (`attribute`) is not x's: it
    names x where every other input shares one value (x is then the odd one, not the
    first tensor compared with it), else `name`."""
    others = {getattr(t, attribute) for t in tensors.values() if t is not x}
    if attribute == "dtype":
        if len(others) == 1:
            return TypeError(f"x has dtype {x.dtype}, but every other input has "
                             f"{others.pop()}; all inputs must share one dtype")
        return _dtype_mismatch(name, tensors[name], x)
    if len(others) == 1:
        return ValueError(f"x is on {x.device}, but every other input is on {others.pop()}; "
                          "all inputs must be on one device")
    return ValueError(f"{name} is on {tensors[name].device}, but x is on {x.device}; all "
                      "inputs must be on one device")


def check_like_x(tensors, x, num_heads, same_dtype=True):
    """Each of `tensors` (name -> tensor, all of SHAPES) has its shape for x [B,S,E] and
    num_heads, and x's device (and dtype, if same_dtype). Where x alone differs in
    dtype or device from the rest, the error names x."""
    shapes = expected_shapes(*x.shape, num_heads)
    for name, t in tensors.items():
        if t.shape != shapes[name]:
            raise ValueError(f"{name} must have shape {shapes[name]} "
                             f"({'x'.join(map(str, SHAPES[name]))}), got {tuple(t.shape)}"
                             + _heads_hint(name, t, x.shape[-1], num_heads))
        if same_dtype and t.dtype != x.dtype:
            raise _unlike_x(tensors, x, name, "dtype")
        if t.device != x.device:
            raise _unlike_x(tensors, x, name, "device")


# --- the entry points ------------------------------------------------------------------

def check_backward_inputs(tensors, scale, norm_eps, num_heads, ln_grad, precision,
                          check_finite=False):
    """attention_block_backward's arguments (`tensors`: its 13, by name); returns the
    tensors made contiguous (a copy only where one was not) and detached, and scale,
    norm_eps and num_heads as Python float, float, int."""
    check_precision(precision, FUSED_PRECISIONS)
    for name, t in tensors.items():
        check_tensor(name, t)
    check_one_of("ln_grad", ln_grad, LN_GRAD_MODES)
    num_heads = check_positive_int("num_heads", num_heads)
    scale = check_float("scale", scale)
    norm_eps = check_float("norm_eps", norm_eps, minimum=0)

    x = tensors["x"]
    check_dtype(x, supported_dtypes(x.device))
    check_x(x)
    B, S, E = x.shape
    check_heads_divide(E, num_heads, " (x's embed dim)")
    if min(B, S, E) < 1:
        raise ValueError(f"x must have batch, sequence length and embed dim >= 1, got "
                         f"{tuple(x.shape)}")
    check_like_x(tensors, x, num_heads)
    if check_finite:
        for name, t in tensors.items():
            if not torch.isfinite(t).all():
                raise ValueError(f"{name} contains NaN or Inf")
    return ({name: t.detach().contiguous() for name, t in tensors.items()},
            scale, norm_eps, num_heads)


def check_block_inputs(x, params, num_heads, eps, gamma=None):
    """vision_attention's tensors and configuration, in any floating dtypes (it casts):
    x [B,S,E], the six BLOCK_PARAMS and gamma (if given) of their shapes on x's device;
    returns num_heads and eps as int and float."""
    if torch.jit.is_tracing():
        # shapes are tensors under tracing, and the fused path's Python decisions (routing,
        # compiled graphs, CUDA graphs) would be frozen into the trace
        raise RuntimeError("vitattn_bwd's block does not support torch.jit.trace; use "
                           "torch.export or torch.compile, or trace the stock model "
                           "(vitattn_bwd.integrations.unswap_attention)")
    check_x(x)
    if x.device.type == "meta":
        # routing reads torch's autocast state for x's device, which meta has none of
        raise ValueError("x is on the meta device: the block computes on real devices "
                         "(cpu, cuda); materialize the model first (.to_empty(device=...) "
                         "and load its weights)")
    tensors = dict(zip(BLOCK_PARAMS, params))
    if gamma is not None:
        tensors["gamma"] = gamma
    for name, t in tensors.items():
        check_tensor(name, t)
    _, num_heads, eps = check_config(x.shape[-1], num_heads, eps)
    check_like_x(tensors, x, num_heads, same_dtype=False)
    for name, t in (("x", x), *tensors.items()):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return num_heads, eps


def check_fused_inputs(x, params, num_heads, eps, products):
    """What the fused path takes (module.VisionAttentionFunction's docstring): the block's
    inputs (check_block_inputs), then check_fused_dtypes; returns num_heads and eps as int
    and float."""
    num_heads, eps = check_block_inputs(x, params, num_heads, eps)
    check_fused_dtypes(x, params, products)
    return num_heads, eps


def check_fused_dtypes(x, params, products):
    """The fused path's own conditions on inputs that passed check_block_inputs: a
    precision.Products of the fused path (fused_products'), and the block's inputs all in
    one dtype of supported_dtypes, or of that half dtype on the one-product path."""
    if not isinstance(products, Products) or products is Products.PLAIN:
        raise TypeError(f"products must be a vitattn_bwd.precision.Products other than "
                        f"PLAIN, got {products!r}")
    half_dtype = products.half_dtype
    if half_dtype is not None and x.dtype not in (torch.float32, half_dtype):
        raise TypeError(f"products {products.value!r} takes float32 tensors or tensors of "
                        f"{half_dtype}, got {x.dtype}")
    check_dtype(x, supported_dtypes(x.device) + ((half_dtype,) if half_dtype else ()),
                " (vitattn_bwd.module.vision_attention casts)")
    for name, t in zip(BLOCK_PARAMS, params):
        if t.dtype != x.dtype:
            raise _dtype_mismatch(name, t, x)
