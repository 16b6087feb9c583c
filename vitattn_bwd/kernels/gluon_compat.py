"""The Gluon names that moved between Triton releases, chosen by what the installed
triton offers (never by its version string), so that kernels/softmax_bwd_gluon.py and
kernels/attention_bwd_ws.py read the same on every release:

    cta_barrier()                      gl.barrier (3.7+), gl.thread_barrier (3.6)
    async_load(smem, pointers, mask)   cp.async global -> shared: async_copy.async_load
                                       (3.8+), async_copy_global_to_shared (3.6, 3.7)
    tma_load(desc, coords, bar, smem)  tma.async_load, else async_copy_global_to_shared
    tma_store(desc, coords, smem)      tma.async_store (3.8+), else
                                       async_copy_shared_to_global
    tma_add(desc, coords, smem)        TMA add into global memory: tma.async_atomic_add
                                       (3.8+); on 3.6 and 3.7 the builder's op, called
                                       as 3.8 calls it
    compile_without_launch(kernel, signature, constexprs, arch, **options)
                                       (host) triton.compile of a Gluon kernel for
                                       compute capability `arch`, for the CPU checks

Each pair lowers to the same instructions, so the kernels' machine code does not depend
on which name was found (scripts/kernel_resources.py --sass on each release shows it).
`MISSING` lists what this triton lacks of the rest the kernels use (empty where they
compile).
"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma


def _first(module, *names):
    """The first of `names` that `module` has, else None."""
    return next((getattr(module, name) for name in names if hasattr(module, name)), None)


cta_barrier = _first(gl, "barrier", "thread_barrier")
async_load = _first(async_copy, "async_load", "async_copy_global_to_shared")
tma_load = _first(tma, "async_load", "async_copy_global_to_shared")
tma_store = _first(tma, "async_store", "async_copy_shared_to_global")


def _tma_add_from_builder():
    """tma.async_atomic_add as triton 3.8 builds it, from the builder op 3.6 and 3.7 have
    (their private modules, imported only there)."""
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def tma_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                                  tensor_desc.handle, coord, src.handle)
    return tma_add


tma_add = _first(tma, "async_atomic_add") or _tma_add_from_builder()

# Everything else the kernels name, which every release from 3.6 to 3.9 has.
_REQUIRED = {gl: ("NVMMADistributedLayout", "DotOperandLayout", "BlockedLayout",
                  "SliceLayout", "NVMMASharedLayout", "allocate_shared_memory",
                  "inline_asm_elementwise", "convert_layout", "static_range"),
             async_copy: ("commit_group", "wait_group", "mbarrier_arrive"),
             hopper: ("fence_async_shared", "warpgroup_mma", "warpgroup_mma_init",
                      "warpgroup_mma_wait")}
MISSING = tuple(
    [name for name, found in (("barrier", cta_barrier), ("async_load", async_load),
                              ("tma_store", tma_store)) if found is None]
    + [f"{module.__name__}.{name}" for module, names in _REQUIRED.items()
       for name in names if not hasattr(module, name)])


def compile_without_launch(kernel, signature, constexprs, arch, **options):
    """Gluon `kernel` compiled for compute capability `arch` (90: sm_90), launching
    nothing: triton's CompiledKernel (.asm["ptx"], .asm["cubin"], .metadata.shared).
    signature: each argument's type by name, in the kernel's order ("*fp32", "fp32",
    "constexpr", a tensor descriptor's type); pointers are taken 16-byte aligned, as
    torch allocates. options: triton's (num_warps, maxnreg, ...)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    aligned = {(index,): [["tt.divisibility", 16]]
               for index, kind in enumerate(signature.values()) if kind[0] == "*"}
    return triton_compile(GluonASTSource(kernel, signature, constexprs=constexprs,
                                         attrs=aligned),
                          target=GPUTarget("cuda", arch, 32), options=options)
