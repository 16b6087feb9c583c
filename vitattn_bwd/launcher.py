"""Launching compiled triton and Gluon kernels without triton's JIT path on every call.

`kernel[grid](*args, **kwargs)` (triton's JITFunction.run) binds and specializes every
argument, builds a cache key from their type strings (a Gluon tensor descriptor's
includes its layout's repr) and looks the compiled kernel up, on every call: on a CPU
core with the driver's launch stubbed, 55.7 us for the warp-specialized backward's main
kernel and 27.5 for its delta kernel (triton 3.6), against ~1 us for the compiled
kernel's own launch and 2.9-6.0 us for this module's checks and key. On the H200's host
the backward's launcher took 186-198 us a call this way against 241-254 through the JIT
path.

    launch(kernel, grid, *args, **kwargs)

runs the same launch as `kernel[grid](*args, **kwargs)` (args: the kernel's run-time
arguments in order; kwargs: its constexprs, which follow them, and triton's options
such as num_warps). The first call for a specialization goes through the JIT path,
which compiles or finds the kernel and returns it; the compiled kernel is kept, and
later calls launch it through its own `compiled[grid](*args, stream=...)`, the launch
triton's JIT path makes last (the same in triton 3.6 to 3.9), with the launch hooks
(profilers) still called. The cache key holds what triton's binder specializes on
(`specialization_facts`: each tensor's dtype and 16-byte alignment, each integer's
equality to 1, divisibility by 16 and width, each descriptor's dtype, block and
layout), the constexprs and options, the current device, and triton's debug,
instrumentation and (3.9) fpsan settings; tests/test_launcher.py checks, with the
installed triton and the newest, that arguments with the same facts get the same
specialization from triton's own binder, and on the GPU that both paths give the same
bits.

The JIT path stays for: a kernel that is not a JITFunction (the interpreter's), a kernel
with pre-run hooks, a stages-inspection hook (a custom pass pipeline, triton 3.7+), a
grid given as a callable, an argument of a kind the facts do not cover or a keyword
value that cannot be hashed, a constexpr given by position (triton keys on its value,
the facts on its kind), a constexpr global of the kernel that changed since it was
compiled (triton raises there), and a JIT path that returns no compiled kernel.

Importing this module does not import triton (the package's CPU path runs without it):
triton's knobs, driver and JITFunction are bound here at the first launch.
"""
# triton's, bound by _bind_triton at the first launch; a test may patch one in before
knobs = driver = JITFunction = None

# (id(kernel), device, facts, kwargs, triton's knobs) -> (compiled kernel, the
# constexprs' values in the kernel's argument order)
_compiled = {}
_MISSING = object()


def specialization_facts(arg):
    """What triton's binder specializes `arg` on, as a hashable value; None for a kind of
    argument it does not cover."""
    if hasattr(arg, "data_ptr"):                                  # a tensor
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):
        return int, arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31, arg >= 2**63
    if isinstance(arg, float):
        return float
    if hasattr(arg, "block_shape") and hasattr(arg, "base"):     # a tensor descriptor
        return (arg.base.dtype, tuple(arg.block_shape), getattr(arg, "layout", None),
                getattr(arg, "padding", None))
    return None


def _cache_key(kernel, args, kwargs):
    """The cache key of a launch, or None where it cannot be made: an argument the
    facts do not cover, or a keyword value that is not hashable."""
    facts = tuple(map(specialization_facts, args))
    if None in facts:
        return None
    key = (id(kernel), driver.active.get_current_device(), facts, tuple(kwargs.items()),
           knobs.runtime.debug, knobs.compilation.instrumentation_mode,
           getattr(knobs.compilation, "fpsan_homomorphic_casts", None))      # triton 3.9
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _jit_path_only(kernel, grid):
    return (not isinstance(kernel, JITFunction) or kernel.pre_run_hooks or callable(grid)
            or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None)


def _globals_unchanged(kernel):
    """Whether the globals the kernel read when compiled still hold those values (the
    check triton's JIT path makes before each launch)."""
    return all(globals_dict.get(name, _MISSING) == value
               for (name, _), (value, globals_dict) in kernel.used_global_vals.items())


def _bind_triton():
    """Bind triton's knobs, driver and JITFunction to this module's names still unset."""
    global knobs, driver, JITFunction
    from triton import knobs as triton_knobs
    from triton.runtime import driver as triton_driver
    from triton.runtime.jit import JITFunction as triton_jit_function
    knobs = triton_knobs if knobs is None else knobs
    driver = triton_driver if driver is None else driver
    JITFunction = triton_jit_function if JITFunction is None else JITFunction


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`, through the cache of compiled kernels (module
    docstring). grid: a tuple of up to three program counts."""
    if knobs is None or driver is None or JITFunction is None:
        _bind_triton()
    if _jit_path_only(kernel, grid):
        kernel[grid](*args, **kwargs)
        return
    key = _cache_key(kernel, args, kwargs)
    entry = _compiled.get(key) if key is not None else None
    if entry is None or not _globals_unchanged(kernel):
        compiled = kernel[grid](*args, **kwargs)
        if key is not None and hasattr(compiled, "result"):      # an asynchronous compile
            compiled = compiled.result()
        positional_constexpr = any(param.is_constexpr for param in kernel.params[:len(args)])
        constexpr_names = kernel.arg_names[len(args):]
        if (key is not None and hasattr(compiled, "__getitem__") and not positional_constexpr
                and all(name in kwargs for name in constexpr_names)):
            _compiled[key] = compiled, tuple(kwargs[name] for name in constexpr_names)
        return
    compiled, constexprs = entry
    grid_3d = (*grid, 1, 1)[:3]                    # the compiled launch takes all three
    compiled[grid_3d](*args, *constexprs, stream=driver.active.get_current_stream(key[1]))
