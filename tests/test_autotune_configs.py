"""Max-autotune in our compiles offers no GEMM config that cannot fit the device's shared
memory (inductor.compile_options). Without a GPU: Inductor's own CUDA mm heuristic asked
for its float32 configs on a device reporting an H200's 232,448 bytes per block, under
our options and under Inductor's defaults. (On the GPU: tests/test_gpu_autotune_logs.py
compiles a float32 block and reads Inductor's log.)"""
import types

import pytest
import torch

H200_SHARED_BYTES = 232448          # cudaDevAttrMaxSharedMemoryPerBlockOptin on an H200


def _shared_bytes(config, dtype_size):
    """What a config's A and B tiles take over its pipeline stages (Triton's own need is
    this, e.g. 262,144 bytes for the 128 x 128 x 64 x 4-stage tile it refused)."""
    k = config.kwargs
    return (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] * dtype_size * config.num_stages


def _float32_mm_configs(options, monkeypatch):
    """The float32 mm configs Inductor's CUDA heuristic offers for the block's weight
    gradient GEMM at batch 32 ([1024, 18464] @ [18464, 1024]) under `options`."""
    from torch._inductor import config
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic
    from torch._inductor.virtualized import V
    device = types.SimpleNamespace(shared_memory_per_block_optin=H200_SHARED_BYTES)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: device)
    with V.set_graph_handler(types.SimpleNamespace(sizevars=SizeVarAllocator())), \
            config.patch(options):
        return list(CUDAConfigHeuristic().get_mm_configs()(1024, 1024, 18464, dtype_size=4))


def test_our_compiles_offer_only_gemm_configs_that_fit(monkeypatch):
    pytest.importorskip("torch._inductor.template_heuristics.triton")
    from vitattn_bwd.inductor import compile_options
    options = compile_options("test-autotune-configs", max_autotune=True)
    del options["post_grad_custom_post_pass"]       # a pass object, not needed here
    defaults = _float32_mm_configs({}, monkeypatch)
    ours = _float32_mm_configs(options, monkeypatch)
    too_big = [c for c in defaults if _shared_bytes(c, 4) > H200_SHARED_BYTES]
    assert too_big, "Inductor's defaults no longer offer configs too big for an H200"
    assert ours and all(_shared_bytes(c, 4) <= H200_SHARED_BYTES for c in ours)
    assert len(ours) == len(defaults) - len(too_big)   # only those that cannot fit go


def test_default_compiles_leave_inductor_config_alone():
    """Without max-autotune nothing about autotune candidates is set, and building the
    options changes no process-wide Inductor setting."""
    from torch._inductor import config
    from vitattn_bwd.inductor import compile_options
    before = config.max_autotune_prune_choices_based_on_shared_mem
    options = compile_options("test-autotune-configs", max_autotune=False)
    compile_options("test-autotune-configs", max_autotune=True)
    assert "max_autotune_prune_choices_based_on_shared_mem" not in options
    assert config.max_autotune_prune_choices_based_on_shared_mem == before
