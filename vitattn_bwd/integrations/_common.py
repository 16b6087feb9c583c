"""What the Hugging Face, timm and OpenCLIP integrations share: the swap plan (match every
layer, check every match, then swap them all or none), swap / unswap and what a swapped
layer carries (its stock class, num_heads, precision and path), the fused subclasses made
per stock class, the fused attention half with an optional LayerScale folded in, and the
refusal messages.

A library module (hf, timm, open_clip) provides only what differs, three functions:
`_match(layer) -> kind or None`, `_check_layer(path, layer, kind) -> num_heads` (raises
ValueError naming `path` and the reason) and `_fused_class(stock_cls, kind)`.
"""
import importlib
import sys

from torch import nn

from ..module import vision_attention
from ..validation import check_config, check_precision

STOCK_CLASS = "_vitattn_stock_class"


def is_swapped(layer):
    """True if `layer`'s class is a fused subclass made by a swap (any integration)."""
    return STOCK_CLASS in type(layer).__dict__


def _in_vision_tower(model, name):
    """True if `model` or a module on the path to `name` has "Vision" in its class name,
    and no module below `model` on that path is a text tower (a class name with "Text"
    and without "Vision": the text tower of a VisionTextDualEncoderModel)."""
    modules = [model]
    for part in name.split(".") if name else []:
        modules.append(getattr(modules[-1], part))
    names = [type(module).__name__.lower() for module in modules]
    if any("text" in n and "vision" not in n for n in names[1:]):
        return False
    return any("vision" in n for n in names)


class ClassRegistry:
    """The classes a swap matches, by kind ("block", "attention", ...): those registered
    (vendored copies of a library's code) and, once the library's `module` has been
    imported by someone else, its own classes of the given names (kind -> names). The
    library is never imported here."""

    def __init__(self, module, names):
        self.module, self.names = module, names
        self.registered = {kind: [] for kind in names}

    def register(self, **classes_by_kind):
        """kind=class or kind=classes, for kinds of `names`."""
        for kind, classes in classes_by_kind.items():
            for cls in (classes,) if isinstance(classes, type) else classes:
                if cls not in self.registered[kind]:
                    self.registered[kind].append(cls)

    def known(self, kind):
        classes = list(self.registered[kind])
        module = sys.modules.get(self.module)
        for name in self.names[kind] if module is not None else ():
            cls = getattr(module, name, None)
            if isinstance(cls, type) and cls not in classes:
                classes.append(cls)
        return classes


def block_parameters(norm, qkv_weight, qkv_bias, out_weight, out_bias):
    """(ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias) of the fused
    block, from a LayerNorm and the projections' tensors; a None bias or LayerNorm
    affine parameter is the identity's (zeros / ones)."""
    E = qkv_weight.shape[-1]
    ln_weight = norm.weight if norm.weight is not None else qkv_weight.new_ones(E)
    ln_bias = norm.bias if norm.bias is not None else qkv_weight.new_zeros(E)
    if qkv_bias is None:
        qkv_bias = qkv_weight.new_zeros(3 * E)
    if out_bias is None:
        out_bias = out_weight.new_zeros(E)
    return ln_weight, ln_bias, qkv_weight, qkv_bias, out_weight, out_bias


def fused_attention(x, norm, qkv_weight, qkv_bias, out_weight, out_bias, num_heads,
                    gamma=None, precision=None):
    """x + gamma * out(attention(qkv(norm(x)))) through vision_attention (with its
    `precision` and its handling of gamma, a LayerScale's [E] vector or None:
    vitattn_bwd.module), the parameters as block_parameters gives them."""
    return vision_attention(x, *block_parameters(norm, qkv_weight, qkv_bias, out_weight,
                                                 out_bias),
                            num_heads, norm.eps, precision, gamma)


def precision_of(layer):
    """The `precision` a swapped layer was given at the swap."""
    return getattr(layer, "_vitattn_precision", None)


def _who(layer):
    path = getattr(layer, "_vitattn_path", None)
    name = type(layer).__name__
    return f"{path} ({name}, vitattn_bwd fused attention)" if path else \
        f"{name} (vitattn_bwd fused attention)"


def refuse_mask(layer, what):
    raise ValueError(f"{_who(layer)} does not "
                     f"support {what}: got one. Vision towers pass none; "
                     "vitattn_bwd.integrations.unswap_attention(model) restores the stock "
                     "layers.")


def refuse_in_training(layer, what, value):
    raise ValueError(f"{_who(layer)} with dropout in training mode: {what} {value} > 0 is not "
                     "supported (the fused block has no dropout). Set it to 0, or call "
                     "the model in eval mode, or "
                     "vitattn_bwd.integrations.unswap_attention(model).")


def dropout_p(module):
    """The probability of an nn.Dropout (0 for Identity / None / anything else)."""
    return float(getattr(module, "p", 0.0) or 0.0)


def qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _not_stock_message(attr, module, stock):
    return (f"{attr} is {qualified_name(type(module))}, whose forward is not "
            f"{qualified_name(stock)}'s: "
            "the fused block reads its weight and bias and never calls it, so what it adds "
            "(a LoRA or other adapter, a quantized or instrumented layer) would be left out; "
            "merge it into the weights, or keep this layer stock")


def check_stock_forward(path, module, attr, stock):
    """Refuse, at the swap, a submodule (`attr` of the layer at `path`) whose forward is
    not `stock`'s (nn.Linear: the projections, where adapters go; the libraries' own
    LayerNorm subclasses, OpenCLIP's casting ones, are LayerNorms that the fused block
    computes as its own): subclasses that keep it pass."""
    if type(module).forward is not stock.forward:
        raise ValueError(f"{path}: {_not_stock_message(attr, module, stock)}")


def refuse_replaced(layer, submodules):
    """At a swapped layer's call: refuse a submodule replaced since the swap by one whose
    forward is not the stock one; submodules: (attr, module, stock class) triples. A
    type comparison per submodule (under torch.compile, a guard)."""
    for attr, module, stock in submodules:
        if type(module).forward is not stock.forward:
            raise ValueError(f"{_who(layer)}: {_not_stock_message(attr, module, stock)}")


def check_layer_norm(path, norm, attr, E, known=()):
    """Refuse, at the swap, a norm the fused block would not compute as its LayerNorm:
    not an nn.LayerNorm, or a subclass whose forward is neither nn.LayerNorm's nor that
    of one of the library's `known` classes (timm's and OpenCLIP's casting LayerNorms),
    or of another width than the embed dim."""
    if not isinstance(norm, nn.LayerNorm):
        raise ValueError(f"{path}: {attr} is {type(norm).__name__}, not a LayerNorm (the "
                         "fused block normalizes with LayerNorm)")
    if not stock_forward_is(type(norm), (nn.LayerNorm, *known)):
        raise ValueError(f"{path}: {attr} is {qualified_name(type(norm))}, a LayerNorm "
                         "whose forward is its own: the fused block computes a plain "
                         "LayerNorm and never calls it, so what it adds would be left "
                         "out; keep this layer stock")
    if tuple(norm.normalized_shape) != (E,):
        raise ValueError(f"{path}: {attr} normalizes {tuple(norm.normalized_shape)}, not "
                         f"the embed dim ({E},)")


def check_linear(path, lin, attr, in_features, out_features, what=""):
    if not isinstance(lin, nn.Linear):
        raise ValueError(f"{path}: {attr} is {type(lin).__name__}, not an nn.Linear")
    check_stock_forward(path, lin, attr, nn.Linear)
    if (lin.in_features, lin.out_features) != (in_features, out_features):
        raise ValueError(f"{path}: {attr} maps {lin.in_features} -> {lin.out_features}, "
                         f"not {in_features} -> {out_features}{what}")


def _hook_name(hook):
    return f"{getattr(hook, '__module__', None)}.{getattr(hook, '__qualname__', hook)}"


def check_not_hooked(path, layer, bypassed, library_hook=lambda hook: False,
                     methods=("forward",)):
    """The swapped forward calls neither the layer's stock forward (nor its other stock
    `methods`, e.g. OpenCLIP's `attention`) nor the forwards of the submodules in
    `bypassed` (attr -> module) and of any module under them: refuse what would silently
    stop working, one of those methods set on the instance (accelerate's device_map /
    offload hooks set forward; attention-editing code sets others), or forward,
    forward-pre, backward or backward-pre hooks on any of those modules, except the
    hooks for which library_hook(hook) is true (a library's own, which the swapped layer
    serves another way)."""
    overridden = [method for method in methods if method in vars(layer)]
    if overridden or hasattr(layer, "_hf_hook"):
        raise ValueError(f"{path}: its {(overridden or ['forward'])[0]} is overridden on "
                         "the instance (accelerate's device_map/offload hooks do this to "
                         "forward), which the swap would bypass; swap a model without it")
    for attr, root in bypassed.items():
        if root is None:
            continue
        for name, module in root.named_modules(prefix=attr):
            if "forward" in vars(module) or hasattr(module, "_hf_hook"):
                raise ValueError(f"{path}: {name}.forward is overridden on the instance "
                                 "(accelerate's device_map/offload hooks do this); the "
                                 "fused block would bypass it. Swap a model loaded "
                                 "without device_map")
            for kind, hooks in (("forward", module._forward_hooks),
                                ("forward-pre", module._forward_pre_hooks),
                                ("backward", module._backward_hooks),
                                ("backward-pre", module._backward_pre_hooks)):
                foreign = [_hook_name(h) for h in hooks.values() if not library_hook(h)]
                if foreign:
                    raise ValueError(
                        f"{path}: {name} has {kind} hooks ({', '.join(foreign)}), which "
                        "would no longer fire: the fused block does not call its "
                        "forward. Remove them, or put them on the layer itself, before "
                        "the swap")


def check_heads_and_eps(path, E, num_heads, eps, head_dim=None, scale=None):
    try:
        check_config(E, num_heads, eps)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: the fused block cannot take this layer: {err}") from None
    want = E // num_heads
    if head_dim is not None and head_dim != want:
        raise ValueError(f"{path}: head_dim {head_dim} is not embed_dim / num_heads = {want}")
    if scale is not None and abs(float(scale) - want ** -0.5) > 1e-6 * want ** -0.5:
        raise ValueError(f"{path}: attention scale {scale} is not 1/sqrt(head_dim) "
                         f"= {want ** -0.5}")


def check_attention_heads(path, attn, E, eps):
    """num_heads of a library's attention module `attn`, checked against the width E and
    the LayerNorm's eps (and attn's head_dim and scale where it has them)."""
    num_heads = getattr(attn, "num_heads", None)
    if num_heads is None:
        raise ValueError(f"{path}: attn has no num_heads attribute")
    check_heads_and_eps(path, E, num_heads, eps, head_dim=getattr(attn, "head_dim", None),
                        scale=getattr(attn, "scale", None))
    return num_heads


def check_layer_scale(path, ls, name, E, known, library):
    """The layer's LayerScale `ls` (attribute `name`) is an Identity, or `library`'s own
    LayerScale (`known`, stock_forward_is) with a [E] gamma parameter."""
    if isinstance(ls, nn.Identity):
        return
    if not stock_forward_is(type(ls), known):
        raise ValueError(f"{path}: {name} is {type(ls).__name__}, neither Identity nor "
                         f"{library}'s LayerScale")
    gamma = getattr(ls, "gamma", None)
    if not isinstance(gamma, nn.Parameter) or tuple(gamma.shape) != (E,):
        raise ValueError(f"{path}: {name}.gamma must be a parameter of shape ({E},), got "
                         f"{None if gamma is None else tuple(gamma.shape)}")


def stock_forward_is(cls, known, methods=("forward",)):
    """True if `cls` is (a subclass of) one of the `known` classes and runs its forward
    (and its other `methods`) unchanged."""
    return any(issubclass(cls, k) and all(getattr(cls, m) is getattr(k, m) for m in methods)
               for k in known)


def make_fused_class(stock_cls, kind, forward, module_globals, cache, library,
                     attributes=None):
    """The subclass of `stock_cls` (a layer of `kind`, the library's _match) whose forward
    is `forward` (and which has the class `attributes`, a dict, if given), made once per
    class and put in the integration module's namespace. Its instances pickle as the
    library's fused class of (stock_cls, kind), made again where they are loaded
    (_rebuild_swapped): a process that has not swapped has no fused class to find by
    name."""
    cls = cache.get(stock_cls)
    if cls is None:
        base = f"VitAttn{stock_cls.__name__}"
        name, n = base, 2
        while name in module_globals:            # another stock class of the same name
            name, n = f"{base}{n}", n + 1
        recipe = (module_globals["__name__"], stock_cls, kind)
        cls = type(name, (stock_cls,), {
            "forward": forward,
            "__reduce_ex__": lambda self, protocol: (_rebuild_swapped, recipe,
                                                     self.__getstate__()),
            STOCK_CLASS: stock_cls,
            "__module__": module_globals["__name__"],
            "__qualname__": name,
            "__doc__": f"{stock_cls.__name__} whose attention half runs vitattn_bwd's "
                       f"fused block ({module_globals['__name__']}, {library}).",
            **(attributes or {}),
        })
        cache[stock_cls] = cls
        module_globals[name] = cls
    return cls


def _rebuild_swapped(library, stock_cls, kind):
    """An empty instance of `library`'s (a module name) fused class of (stock_cls, kind),
    for pickle and copy to fill with a swapped layer's state."""
    cls = importlib.import_module(library)._fused_class(stock_cls, kind)
    return cls.__new__(cls)


def plan_swaps(model, libraries, vision_only):
    """[(path, layer, library module, kind, num_heads)] for every unswapped layer of
    `model` that a library matches (inside a *Vision* module if vision_only); every match
    is checked, so a refusal raises before anything is swapped."""
    plan = []
    for name, layer in model.named_modules():
        if is_swapped(layer):
            continue
        for lib in libraries:
            kind = lib._match(layer)
            if kind is None:
                continue
            if not vision_only or _in_vision_tower(model, name):
                num_heads = lib._check_layer(name or "model", layer, kind)
                plan.append((name, layer, lib, kind, num_heads))
            break
    return plan


def apply_plan(plan, precision):
    for name, layer, lib, kind, num_heads in plan:
        layer.__class__ = lib._fused_class(type(layer), kind)
        layer._vitattn_num_heads = num_heads
        layer._vitattn_precision = precision
        layer._vitattn_path = name or "model"      # for the refusals at the call


def check_swapped_precision(model, libraries, vision_only, precision):
    """ValueError naming `precision` if a layer that one of `libraries` swapped already
    (inside a *Vision* module if vision_only) has another precision: a swap skips the
    swapped layers, so it would silently leave them at their old one."""
    library_modules = {lib.__name__ for lib in libraries}
    others = [f"{name or 'model'} ({precision_of(layer)!r})"
              for name, layer in model.named_modules()
              if is_swapped(layer) and type(layer).__module__ in library_modules
              and precision_of(layer) != precision
              and (not vision_only or _in_vision_tower(model, name))]
    if others:
        raise ValueError(f"precision={precision!r}, but {', '.join(others)} were swapped "
                         "already at another precision; unswap_attention(model) first to "
                         "swap them at this one")


def swap(model, libraries, vision_only, looked_for, precision, what="layer"):
    """Swap every layer of `model` that one of `libraries` matches (plan_swaps, then
    apply_plan); ValueError naming `what` was `looked_for` if there is none and none is
    swapped already, and naming `precision` if a swapped one has another."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_precision(precision)
    check_swapped_precision(model, libraries, vision_only, precision)
    plan = plan_swaps(model, libraries, vision_only)
    if not plan and not swapped_layers(model):
        raise ValueError(
            f"swap_attention found no {what} to swap in {type(model).__name__} (looked for "
            f"{looked_for}" + (", inside a module whose class name contains 'Vision'; "
                               "pass vision_only=False to swap others" if vision_only
                               else "") + ")")
    apply_plan(plan, precision)
    return model


def unswap(model):
    """Restore the stock class of every swapped layer of `model` (any integration)."""
    for _, layer in model.named_modules():
        if is_swapped(layer):
            layer.__class__ = type(layer).__dict__[STOCK_CLASS]
            for attr in [a for a in vars(layer) if a.startswith("_vitattn_")]:
                delattr(layer, attr)
    return model


def swapped_layers(model):
    """Names of the swapped layers of `model`, in module order."""
    return [name for name, layer in model.named_modules() if is_swapped(layer)]


def one_forward_fused_class(module_globals, forward, library):
    """The `_fused_class(stock_cls, kind)` of an integration whose matched layers all run
    one fused `forward` (timm's Block, OpenCLIP's ResidualAttentionBlock): make_fused_class
    with a cache of its own, the classes put in the integration's `module_globals`."""
    cache = {}

    def fused_class(stock_cls, kind):
        return make_fused_class(stock_cls, kind, forward, module_globals, cache, library)
    return fused_class
