"""Whether the Gluon kernels run is decided by compiling them (softmax_bwd_gluon.compile_failure),
not by whether their file imports: here they compile for sm_90 on the CPU, with
the installed triton and the newest (.ci/run); and when they cannot (forced here), the lowerings offer no Gluon
choice, the one-product path gives way to the stock ops, and one warning names the
installed triton."""
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from vitattn_bwd import inductor, module, softmax_bwd_gluon  # noqa: E402
from vitattn_bwd.kernels import gluon_compat  # noqa: E402
from vitattn_bwd.precision import Products  # noqa: E402

from .helpers import triton_environments, triton_version_in  # noqa: E402

CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def hopper(monkeypatch):
    """A CPU machine that says its CUDA device is an sm_90, with compile_failure's
    per-process answer forgotten before and after the test."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    softmax_bwd_gluon.compile_failure.cache_clear()
    yield
    softmax_bwd_gluon.compile_failure.cache_clear()


class _Node:
    """What _gluon_tile_choices asks of an Inductor IR node."""

    def get_device(self):
        return CUDA

    def get_dtype(self):
        return torch.float32


class _Choice:
    def bind(self, inputs, layout, **launch):
        return launch


def _offered_gluon_tiles():
    return inductor._gluon_tile_choices(_Choice(), softmax_bwd_gluon.ROWS_TILES, _Node(), 64,
                                        inputs=(), layout=None, scale=0.125,
                                        products=Products.BF16X3, recompute_p=True)


def test_the_installed_gluon_has_every_name_the_kernels_use():
    assert gluon_compat.MISSING == ()
    assert gluon_compat.cta_barrier is not None and gluon_compat.async_load is not None


@pytest.mark.sm90_compile
@pytest.mark.parametrize("label", list(triton_environments()))
def test_the_kernels_compile_for_sm90(label):
    """compile_failure(90) in a subprocess (the interpreter that conftest turns on for
    the other tests replaces the compiler), with each triton: no warning, None."""
    pytest.importorskip("triton.backends.nvidia")
    environment = triton_environments()[label]
    script = ("import warnings; warnings.simplefilter('error', RuntimeWarning); "
              "from vitattn_bwd import softmax_bwd_gluon; print(softmax_bwd_gluon.compile_failure(90))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (triton_version_in(environment), result.stderr[-3000:])
    assert result.stdout.splitlines()[-1] == "None", result.stdout


def test_gluon_choices_are_offered_where_the_kernels_compile(hopper, monkeypatch):
    monkeypatch.setattr(softmax_bwd_gluon, "_compile_probe", lambda arch: None)
    assert softmax_bwd_gluon.available(CUDA, torch.bfloat16, 64)
    assert len(_offered_gluon_tiles()) == len(softmax_bwd_gluon.ROWS_TILES)


def test_a_kernel_that_does_not_compile_is_never_offered(hopper, monkeypatch):
    import triton

    def fail(arch):
        raise RuntimeError(f"PassManager::run failed for sm_{arch}")

    monkeypatch.setattr(softmax_bwd_gluon, "_compile_probe", fail)
    with pytest.warns(RuntimeWarning, match=f"triton {triton.__version__}.*PassManager"):
        assert not softmax_bwd_gluon.available(CUDA, torch.float32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)       # once per process
        assert not softmax_bwd_gluon.available(CUDA, torch.bfloat16, 64)
        assert _offered_gluon_tiles() == []
        assert not module.one_product_supported(CUDA, torch.bfloat16, 64)


def test_a_gluon_without_a_name_the_kernels_use_falls_back(hopper, monkeypatch):
    monkeypatch.setattr(gluon_compat, "MISSING", ("barrier",))
    with pytest.warns(RuntimeWarning, match="lacks barrier"):
        assert softmax_bwd_gluon.compile_failure(90) == "ImportError: this Gluon lacks barrier"
    assert not softmax_bwd_gluon.available(CUDA, torch.float32, 64)


@pytest.mark.parametrize("fp16_halves", [False, True])
def test_a_batch_past_the_grid_rows_launches_in_chunks_of_whole_images(monkeypatch,
                                                                       fp16_halves):
    """With MAX_GRID_ROWS cut to 6 (batch * heads rows), 5 images of 3 heads launch as
    chunks of 2, 2 and 1 images: each launch's grid rows within the cap, every tensor
    argument the chunk's images (operand_scales, not batched, whole), the constexprs
    those of the whole batch. (The bits: tests/test_gpu_softmax_bwd_gluon.py.)"""
    B, H, S, D = 5, 3, 40, 64
    monkeypatch.setattr(softmax_bwd_gluon, "MAX_GRID_ROWS", 6)
    launches = []
    monkeypatch.setattr(softmax_bwd_gluon.launcher, "launch",
                        lambda kernel, grid, *args, **constexprs: launches.append(
                            (grid, args, constexprs)))
    dtype = torch.float16 if fp16_halves else torch.bfloat16
    halves = [torch.zeros(B, S, H * D, dtype=dtype)] * 2 + [
        torch.zeros(B, H, S, D, dtype=dtype) for _ in range(6)]
    lse, delta = torch.zeros(B, H, S), torch.zeros(B, H, S)
    attn_output = torch.zeros(B, S, H * D)
    sums = torch.zeros(B, 3, H * D)
    grad_q16 = torch.zeros(B, S, H * D, dtype=torch.float16)
    operand_scales = torch.ones(5) if fp16_halves else None
    products = Products.FP16X3 if fp16_halves else Products.BF16X3
    softmax_bwd_gluon.launch_rows(*halves, attn_output, delta, torch.zeros(B, S, 0), sums,
                                  grad_q16, 0.125, softmax_bwd_gluon.ROWS_TILES[0], products,
                                  operand_scales=operand_scales, lse=lse)
    assert [grid for grid, _, _ in launches] == [(1, 6), (1, 6), (1, 3)]
    for (_, args, constexprs), first, count in zip(launches, (0, 2, 4), (2, 2, 1)):
        assert constexprs["NUM_HEADS"] == H and constexprs["SEQ_LEN"] == S
        scales = args[9]
        assert scales is operand_scales if fp16_halves else scales.shape[0] == count
        for arg in args[:9] + args[10:]:
            if torch.is_tensor(arg):                     # a view of images [first, +count)
                assert arg.shape[0] == count and arg.data_ptr() == arg._base[first].data_ptr()
