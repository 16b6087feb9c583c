"""Planted errors: proof that each property can fail.

A plant replaces one entry point, by monkeypatching the module attribute the property
tests call at run time, with a wrapper that damages what goes in or comes out:

    softmax_bwd.attention_backward    ("core": the eager launchers, P or lse given)
    attention_fwd.launch_attention_fwd   ("fwd": the forward's launcher, which the
                                          operator calls on CUDA)
    vitattn_bwd.attention_block_backward ("block": the compiled path, the stateful test)
    vitattn_bwd.contract.run             ("contract": the benchmark entry point)
    forward_graph.attention_fwd, .attention_fwd_split
                                         ("module_fwd": the forward operator as
                                          VisionAttentionBlock's forward calls it: on q,
                                          k, v (the CPU) or on their bf16 split (CUDA))
    module.VisionAttentionFunction.backward ("module_bwd": the module's backward)

Nothing inside vitattn_bwd changes: the plants sit at the boundary that stays stable
while the kernels are rewritten. The tests named *_catches_* apply a plant and assert that
the property fails. VITATTN_PLANT=<name> (read only by tests/) applies the plant to every
ordinary property run as well, which then must fail: e.g.

    VITATTN_PLANT=drop_lo python3 -m pytest -q tests/test_properties.py   # expect failures
"""
import contextlib
import inspect
import math
import os
import threading

import pytest
import torch

import vitattn_bwd
from vitattn_bwd import attention_fwd, contract, forward_graph, module, softmax_bwd

ENV = "VITATTN_PLANT"


def truncate_bf16(t):
    """t with its low 16 mantissa bits of float32 zeroed: the bf16 hi part, lo = 0."""
    if not (torch.is_tensor(t) and t.is_floating_point()):
        return t
    hi = (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)
    return hi.to(t.dtype)


def round_bf16(t):
    """t rounded to the nearest bf16 value (ties to even), by integer masking: a plant
    traced into a compiled graph must survive Inductor, which folds a float32 -> bf16 ->
    float32 cast round trip away."""
    bits = t.float().contiguous().view(torch.int32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return rounded.view(torch.float32).to(t.dtype)


def _args_map(fn, args, kwargs):
    return fn(*(truncate_bf16(a) for a in args),
              **{k: truncate_bf16(v) for k, v in kwargs.items()})


def _like(original, values):
    """Rebuild the entry point's return type (tuple or BlockGrads) from a list."""
    return type(original)(*values) if hasattr(original, "_fields") else type(original)(values)


def _with_outputs(change):
    """Wrapper factory: call the original, then `change(list_of_outputs)` in place on
    copies of its tensors (entries that are not tensors, e.g. the None gradients of an
    autograd Function's non-tensor arguments, are left out of the list)."""
    def wrap(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            values = [t.clone() if torch.is_tensor(t) else t for t in out]
            tensors = [t for t in values if torch.is_tensor(t)]
            change(tensors)
            it = iter(tensors)
            return _like(out, [next(it) if torch.is_tensor(t) else t for t in values])
        return wrapper
    return wrap


def _drop_lo(fn):
    def wrapper(*args, **kwargs):
        return _args_map(fn, args, kwargs)
    return wrapper


def _drop_lo_split(fn):
    """drop_lo for attention_fwd_split(qkv_hi, qkv_lo, ...): q, k, v are its hi parts."""
    def wrapper(qkv_hi, qkv_lo, *args, **kwargs):
        return fn(qkv_hi, torch.zeros_like(qkv_lo), *args, **kwargs)
    return wrapper


def _round_core(values):          # grad_q and grad_v: the bf16x3 outputs
    values[0], values[2] = round_bf16(values[0]), round_bf16(values[2])


def _round_all(values):
    values[:] = [round_bf16(v) for v in values]


def _zero_last_token(values):      # grad_q / grad_x / attn_output [B,S,E]
    values[0][:, -1] = 0


LSE_SHIFT = 0.01


def _shift_lse_out(values):        # the forward's (attn_output, lse): lse + 0.01
    values[1] += LSE_SHIFT


def _shift_probs(fn):
    """The probabilities the core reads scaled by exp(-0.01): its lse argument + 0.01
    (module mode), or P * exp(-0.01) (P given)."""
    def wrapper(*args, probs=None, lse=None, **kwargs):
        if lse is not None:
            lse = lse + LSE_SHIFT
        else:
            probs = probs * math.exp(-LSE_SHIFT)
        return fn(*args, probs=probs, lse=lse, **kwargs)
    return wrapper


def _vector_misses(values):        # 4 of grad_ln_weight's elements 10x outside tolerance
    w = values[5]
    w[:4] += 0.1 + 0.1 * w[:4].abs()


def _matrix_misses(values):        # 0.2% of grad_x's elements 10x outside tolerance
    flat = values[0].view(-1)
    flat[::500] += 0.1 + 0.1 * flat[::500].abs()


def _swap_ln_block(fn):
    def wrapper(*args, ln_grad="exact", **kwargs):
        return fn(*args, ln_grad="contract" if ln_grad == "exact" else "exact", **kwargs)
    return wrapper


def _exact_ln_contract(fn):
    def wrapper(*args):
        return tuple(vitattn_bwd.api.attention_block_backward(
            *args, num_heads=args[7].shape[1], ln_grad="exact"))
    return wrapper


def _mutate_input(fn):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        x = kwargs["x"] if "x" in kwargs else args[1]
        with torch.no_grad():
            x[(0,) * x.dim()] += 1.0
        return out
    return wrapper


def _leak_setting(fn):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
        return out
    return wrapper


def _setting_during_call(fn):
    """Change process-wide settings for the duration of the call only (restored before
    returning): only an observer on another thread sees it."""
    def wrapper(*args, **kwargs):
        saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("medium" if saved != "medium" else "high")
        os.environ["VITATTN_PLANTED_DURING_CALL"] = "1"
        try:
            return fn(*args, **kwargs)
        finally:
            os.environ.pop("VITATTN_PLANTED_DURING_CALL", None)
            torch.set_float32_matmul_precision(saved)
    return wrapper


_calls = [0]
_calls_lock = threading.Lock()


def _recompile(fn):
    """Every call a configuration key of its own (scale moved by a few ulps): one new
    graph per call, as a cache keyed on something unstable would give."""
    def wrapper(*args, scale=None, **kwargs):
        with _calls_lock:
            _calls[0] += 1
            n = _calls[0]
        return fn(*args, scale=scale * (1 + n * 2.0 ** -45), **kwargs)
    return wrapper


# plant name -> (what it models, {target: wrapper factory, or {attribute: factory} where
# a target's attributes take different arguments})
PLANTS = {
    "drop_lo": ("every float argument truncated to bf16 (its lo part zero): the kernels' "
                "operands without their lo halves (fwd, module_fwd: q, k, v)",
                {"core": _drop_lo, "block": _drop_lo, "contract": _drop_lo,
                 "fwd": _drop_lo, "module_fwd": {"attention_fwd": _drop_lo,
                                                 "attention_fwd_split": _drop_lo_split}}),
    "round_out": ("outputs rounded to bf16 (core: grad_q and grad_v, the bf16x3 outputs; "
                  "block, contract, module_bwd: all seven gradients; fwd, module_fwd: "
                  "attn_output and lse)",
                  {"core": _with_outputs(_round_core), "block": _with_outputs(_round_all),
                   "contract": _with_outputs(_round_all), "fwd": _with_outputs(_round_all),
                   "module_fwd": _with_outputs(_round_all),
                   "module_bwd": _with_outputs(_round_all)}),
    "drop_last_token": ("the last token of grad_q (core) / grad_x (block, contract, "
                        "module_bwd) / attn_output (fwd, module_fwd) zeroed: a masked "
                        "store lost at the sequence's tile edge",
                        {"core": _with_outputs(_zero_last_token),
                         "block": _with_outputs(_zero_last_token),
                         "contract": _with_outputs(_zero_last_token),
                         "fwd": _with_outputs(_zero_last_token),
                         "module_fwd": _with_outputs(_zero_last_token),
                         "module_bwd": _with_outputs(_zero_last_token)}),
    "lse_off": ("the probabilities the backward uses scaled by exp(-0.01): lse + 0.01 out "
                "of the forward (fwd, module_fwd: y unchanged, the gradients off) or into "
                "the core (core: P * exp(-0.01) where P is given)",
                {"core": _shift_probs, "fwd": _with_outputs(_shift_lse_out),
                 "module_fwd": _with_outputs(_shift_lse_out)}),
    "exact_ln": ("the other LayerNorm formula (block: exact <-> contract; contract.run "
                 "answered in the exact mode)",
                 {"block": _swap_ln_block, "contract": _exact_ln_contract}),
    "vector_misses": ("4 elements of grad_ln_weight moved 10x outside the tolerance",
                      {"contract": _with_outputs(_vector_misses)}),
    "matrix_misses": ("every 500th element of grad_x moved 10x outside the tolerance",
                      {"contract": _with_outputs(_matrix_misses)}),
    "mutate_input": ("x modified in place after the call", {"block": _mutate_input}),
    "leak_setting": ("torch.backends.cuda.matmul.allow_tf32 left flipped after the call",
                     {"block": _leak_setting}),
    "setting_during_call": ("float32 matmul precision and os.environ changed during the "
                            "call, restored before it returns",
                            {"block": _setting_during_call}),
    "recompile": ("scale moved by a few ulps per call: a new graph every call",
                  {"block": _recompile}),
}

# target -> the (owner, attribute) pairs it patches
TARGETS = {"core": [(softmax_bwd, "attention_backward")],
           "fwd": [(attention_fwd, "launch_attention_fwd")],
           "block": [(vitattn_bwd, "attention_block_backward")],
           "contract": [(contract, "run")],
           "module_fwd": [(forward_graph, "attention_fwd"),
                          (forward_graph, "attention_fwd_split")],
           "module_bwd": [(module.VisionAttentionFunction, "backward")]}


# Targets called inside one of our compiled graphs: dynamo reads them when it traces,
# and a CUDA graph replay runs no Python at all, so patching them changes nothing once the
# graph exists. While such a plant is applied, the graph is compiled afresh (with the
# plant traced into it), and again without it afterwards (an FX-cache hit).
COMPILED_GRAPHS = {"module_fwd": forward_graph._compile}


def plants_for(*targets):
    """The plants that apply to any of `targets`."""
    return sorted(name for name, (_, wrappers) in PLANTS.items()
                  if any(target in wrappers for target in targets))


def _process_settings():
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision())


def _restore_process_settings(saved):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def plant_targets(*targets):
    """(plant, target) pairs: every plant of each of `targets`, applied to that target
    alone (see planted's `only`)."""
    return [(name, target) for target in targets for name in plants_for(target)]


_ACTIVE = []          # the plants applied now, innermost last


def active():
    """The plant applied now (innermost), or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def planted(name, only=None):
    """Apply plant `name` to every target it has (None: nothing), or to target `only`
    alone, while the block runs; afterwards the entry points and the process-wide
    settings a plant touches are restored."""
    if not name:
        yield
        return
    if name not in PLANTS:
        raise ValueError(f"{ENV}={name!r}: known plants are {sorted(PLANTS)}")
    wrappers = PLANTS[name][1]
    if only is not None:
        wrappers = {only: wrappers[only]}
    saved = _process_settings()
    compiled = [COMPILED_GRAPHS[t] for t in wrappers if t in COMPILED_GRAPHS]
    _ACTIVE.append(name)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for target, factory in wrappers.items():
                for owner, attr in TARGETS[target]:
                    make = factory[attr] if isinstance(factory, dict) else factory
                    wrapper = make(getattr(owner, attr))
                    if isinstance(inspect.getattr_static(owner, attr), staticmethod):
                        wrapper = staticmethod(wrapper)  # an autograd Function's method
                    mp.setattr(owner, attr, wrapper)
            for cached_compile in compiled:
                cached_compile.cache_clear()
            yield
    finally:
        _ACTIVE.pop()
        for cached_compile in compiled:
            cached_compile.cache_clear()
        _restore_process_settings(saved)


def from_env():
    """The plant named by VITATTN_PLANT, or None."""
    return os.environ.get(ENV) or None
