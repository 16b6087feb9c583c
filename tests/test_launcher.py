"""launcher.launch keeps each compiled kernel under a key of its own making
(launcher.specialization_facts); a launch through the cache runs the kernel that
triton's JIT path would have run only if arguments with the same facts always get the
same specialization from triton's own binder. That is checked here with the installed
triton and the newest (.ci/run), for every kernel the package launches through the
cache, on arguments varied one at a time over what the binder distinguishes. The
bitwise comparison of the two paths on the GPU is in tests/test_gpu_attention_bwd_ws.py
and tests/test_gpu_softmax_bwd_gluon.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from vitattn_bwd import launcher  # noqa: E402

from .helpers import triton_environments, triton_version_in  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _tensor(dtype, offset=0):
    """A tensor whose data starts `offset` elements into its storage (1: not 16-byte
    aligned)."""
    return torch.zeros(64, dtype=dtype)[offset:offset + 32]


def _variants(arg):
    """Arguments of arg's kind that triton's binder may specialize differently."""
    if isinstance(arg, torch.Tensor):
        return [_tensor(dtype, offset) for dtype in (torch.float32, torch.bfloat16,
                                                     torch.float16, torch.int32)
                for offset in (0, 1, 8)]
    if isinstance(arg, bool):
        return [False, True]
    if isinstance(arg, int):
        return [1, 2, 16, 17, 48, 2**31 - 16, 2**31, 2**32 + 16, 2**63]
    if isinstance(arg, float):
        return [0.125, 1.0, 3.0]
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    variants = []
    for dtype, element in ((torch.bfloat16, gl.bfloat16), (torch.float32, gl.float32)):
        for block in ([64, 64], [128, 64]):
            base = torch.zeros(256, 64, dtype=dtype)
            default = gl.NVMMASharedLayout.get_default_for(block, element)
            for layout in (default, gl.NVMMASharedLayout(
                    swizzle_byte_width=0, element_bitwidth=default.element_bitwidth,
                    rank=2)):
                variants.append(TensorDescriptor(base, [256, 64], [64, 1], block, layout))
    return variants


def _launches():
    """(kernel, args, kwargs) of each launch the package sends through the cache, as
    the launchers make them on CPU tensors (the GPU-only facts, such as the SM count,
    replaced), recorded instead of launched."""
    from vitattn_bwd import attention_bwd_ws, softmax_bwd_gluon
    from vitattn_bwd.precision import Products
    from vitattn_bwd.softmax_bwd import TileConfig
    recorded = []
    original = launcher.launch
    launcher.launch = lambda kernel, grid, *args, **kwargs: recorded.append(
        (kernel, args, kwargs))
    try:
        batch, heads, seq_len, head_dim = 2, 4, 40, 64
        qkv = torch.zeros(batch, seq_len, 3 * heads * head_dim, dtype=torch.bfloat16)
        q, k, v = qkv.view(batch, seq_len, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        rows = torch.zeros(batch, seq_len, heads * head_dim, dtype=torch.bfloat16)
        lse = torch.zeros(batch, heads, seq_len)
        attention_bwd_ws.launch(q, k, v, rows, rows, lse, 0.125,
                                tiles=attention_bwd_ws.WsTiles(128, 128, 2, 168))
        parts = [torch.zeros(batch, heads, seq_len, head_dim, dtype=torch.bfloat16)] * 8
        other = torch.zeros(1)
        softmax_bwd_gluon.launch_rows(*parts, other, other, torch.zeros(0), other, other,
                                      0.125, TileConfig(64, 32, 4, 2), products=Products.ONE_BF16, lse=lse)
        softmax_bwd_gluon.launch_cols(*parts, other, torch.zeros(0), other, other, 0.125,
                                      TileConfig(32, 64, 4, 3), products=Products.ONE_BF16, lse=lse)
    finally:
        launcher.launch = original
    return recorded


def report():
    """For each recorded launch and each run-time argument varied alone over _variants:
    {kernel name: [whether the facts cover every argument of the launch as made, whether
    every launcher key maps to one binder specialization, the number of distinct
    specializations seen]}, printed as JSON."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(GPUTarget("cuda", 90, 32))
    result = {}
    for kernel, args, kwargs in _launches():
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        covered = None not in map(launcher.specialization_facts, args)
        specialization_by_key, consistent = {}, True
        for position, arg in enumerate(args):
            for variant in [arg, *_variants(arg)]:
                varied = (*args[:position], variant, *args[position + 1:])
                key = (position, tuple(map(launcher.specialization_facts, varied)))
                specialization = repr(binder(*varied, **kwargs)[1])
                if specialization_by_key.setdefault(key, specialization) != specialization:
                    consistent = False
        result[kernel.__name__] = [covered, consistent,
                                   len(set(specialization_by_key.values()))]
    print(json.dumps(result))


@pytest.mark.sm90_compile
@pytest.mark.parametrize("label", list(triton_environments()))
def test_arguments_with_the_same_facts_get_the_same_specialization(label):
    pytest.importorskip("triton.backends.nvidia")
    environment = triton_environments()[label]
    result = subprocess.run([sys.executable, "-c",
                             "from tests.test_launcher import report; report()"],
                            cwd=ROOT, env=environment, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (triton_version_in(environment), result.stderr[-3000:])
    kernels = json.loads(result.stdout.splitlines()[-1])
    assert sorted(kernels) == ["attention_bwd_ws_kernel", "attention_delta_kernel",
                               "softmax_bwd_cols_kernel", "softmax_bwd_rows_kernel"]
    for name, (covered, consistent, distinct) in kernels.items():
        assert covered, name             # every argument of the real launch has its facts
        assert consistent, (triton_version_in(environment), name)
        assert distinct > 10, (name, distinct)       # the variants do reach the binder


class _Compiled:
    """A stand-in for triton's CompiledKernel: records each launch through it."""

    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        def runner(*args, stream):
            assert stream == 7
            self.launches.append(("compiled", grid, args))
        return runner


def _kernel(POINTER, count, WIDTH: tl.constexpr, DEPTH: tl.constexpr):
    pass


class _StandInDriver:
    """What launcher asks of triton's active driver, on a machine without a GPU:
    device 0, stream 7."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7


class StandInDrivers:
    """A stand-in for triton.runtime.driver (its `active` driver), to patch in as
    launcher.driver."""
    active = _StandInDriver()


@pytest.fixture
def stand_in(monkeypatch):
    """(a real JITFunction of _kernel whose JIT path records the call and returns a
    _Compiled, the list of launches recorded), with StandInDrivers as triton's driver
    and the launch cache empty."""
    from triton.runtime.jit import JITFunction

    launches = []
    kernel = JITFunction(_kernel)

    def run(*args, grid, warmup, **kwargs):
        launches.append(("jit", grid, args))
        return _Compiled(launches)
    monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setattr(launcher, "driver", StandInDrivers)
    monkeypatch.setattr(launcher, "_compiled", {})
    return kernel, launches


def _paths(launches):
    return [path for path, _, _ in launches]


def test_the_first_launch_of_a_specialization_takes_the_jit_path_and_later_ones_the_cache(
        stand_in):
    kernel, launches = stand_in
    pointer, misaligned = _tensor(torch.float32), _tensor(torch.float32, 1)
    launcher.launch(kernel, (3,), pointer, 5, WIDTH=64, DEPTH=2)
    launcher.launch(kernel, (4,), pointer, 7, WIDTH=64, DEPTH=2)    # same facts
    launcher.launch(kernel, (4,), pointer, 16, WIDTH=64, DEPTH=2)   # count % 16 == 0
    launcher.launch(kernel, (4,), misaligned, 7, WIDTH=64, DEPTH=2)
    launcher.launch(kernel, (4,), pointer, 7, WIDTH=32, DEPTH=2)    # another constexpr
    launcher.launch(kernel, (5,), pointer, 9, WIDTH=32, DEPTH=2)
    assert [(path, grid, args[1:]) for path, grid, args in launches] == [
        ("jit", (3,), (5,)), ("compiled", (4, 1, 1), (7, 64, 2)), ("jit", (4,), (16,)),
        ("jit", (4,), (7,)), ("jit", (4,), (7,)), ("compiled", (5, 1, 1), (9, 32, 2))]


def test_pre_run_hooks_keep_the_jit_path(stand_in):
    kernel, launches = stand_in
    kernel.add_pre_run_hook(lambda *args, **kwargs: None)
    for _ in range(2):
        launcher.launch(kernel, (1,), _tensor(torch.float32), 5, WIDTH=64, DEPTH=2)
    assert _paths(launches) == ["jit", "jit"]


@pytest.mark.parametrize("count, width", [(None, 64), (5, [64])],
                         ids=["argument-not-covered", "unhashable-constexpr"])
def test_what_the_key_cannot_hold_keeps_the_jit_path(stand_in, count, width):
    kernel, launches = stand_in
    for _ in range(2):
        launcher.launch(kernel, (1,), _tensor(torch.float32), count, WIDTH=width, DEPTH=2)
    assert _paths(launches) == ["jit", "jit"]
    assert launcher._compiled == {}


def test_a_constexpr_given_by_position_keeps_the_jit_path(stand_in):
    """triton keys a constexpr on its value; the facts would key it on its kind."""
    kernel, launches = stand_in
    for width in (64, 32):
        launcher.launch(kernel, (1,), _tensor(torch.float32), 5, width, DEPTH=2)
    assert _paths(launches) == ["jit", "jit"]
    assert launcher._compiled == {}


def test_a_callable_grid_and_a_stages_hook_keep_the_jit_path(stand_in, monkeypatch):
    from triton import knobs
    kernel, launches = stand_in
    for _ in range(2):
        launcher.launch(kernel, lambda meta: (1,), _tensor(torch.float32), 5, WIDTH=64,
                        DEPTH=2)
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", lambda: ("k", "h"))
    for _ in range(2):
        launcher.launch(kernel, (1,), _tensor(torch.float32), 5, WIDTH=64, DEPTH=2)
    assert _paths(launches) == ["jit"] * 4
    assert launcher._compiled == {}


def test_a_changed_global_goes_back_to_the_jit_path(stand_in, monkeypatch):
    """Where a global the kernel read when compiled has changed, triton's JIT path
    raises; the cache must not launch the old binary instead."""
    kernel, launches = stand_in
    module_globals = {"BLOCK": 64}
    monkeypatch.setattr(kernel, "used_global_vals",
                        {("BLOCK", id(module_globals)): (64, module_globals)})
    for _ in range(2):
        launcher.launch(kernel, (1,), _tensor(torch.float32), 5, WIDTH=64, DEPTH=2)
    module_globals["BLOCK"] = 128
    launcher.launch(kernel, (1,), _tensor(torch.float32), 5, WIDTH=64, DEPTH=2)
    assert _paths(launches) == ["jit", "compiled", "jit"]
