"""On a CUDA GPU: a contract call, or VisionAttentionBlock's forward or backward, that runs
out of device memory, in a batch size's first compile (autotuning included) or in its
run, raises torch.OutOfMemoryError, and the next calls, at that size and another, are
right."""
import gc

import pytest
import torch

from vitattn_bwd import VisionAttentionBlock, contract
from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs, within_tolerance

from .helpers import (block_step, block_step_float64, float32_grade_bound, reference_grads,
                      relative_errors)

pytestmark = pytest.mark.gpu


def _capped_allocator(slack_bytes):
    """The caching allocator capped (until set back to 1.0) at what is allocated now,
    after garbage collection, plus slack_bytes."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(
        (torch.cuda.memory_allocated() + slack_bytes) / total)


def test_contract_out_of_memory_is_torch_out_of_memory_and_the_next_call_is_right():
    """The caching allocator is capped (for this test only) at what the inputs of a new
    batch size take plus 256 MB: far less than its compile and run need. (Garbage of
    earlier tests is collected first: freed during the call, it had made room under the
    cap.)"""
    inputs = make_inputs(44, device="cuda")                   # not a benchmark size
    _capped_allocator(2 ** 28)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            contract.run(*inputs.values())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    for batch in (44, 3):                 # the size that ran out, and another
        inputs = make_inputs(batch, device="cuda")
        refs = reference_grads(inputs, 16, "contract", dtype=torch.float32, device="cuda")
        for name, out, ref in zip(OUTPUT_NAMES, contract.run(*inputs.values()), refs):
            ok, matched = within_tolerance(out, ref)
            assert ok, (batch, name, matched)


@pytest.mark.usefixtures("no_tf32")
def test_block_past_the_gpu_memory_raises_out_of_memory_and_the_next_step_is_right(
        monkeypatch):
    """VisionAttentionBlock's no_grad forward at a batch whose x takes a fifth of the free
    GPU memory (batch * 16 heads past 65,535 on an 80 GB card), so that its QKV
    projection alone cannot fit: torch.OutOfMemoryError, not another error; a small
    batch then runs right."""
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning
    torch.manual_seed(0)
    free, _ = torch.cuda.mem_get_info()
    batch = free // 5 // (577 * 1024 * 4)
    block = VisionAttentionBlock(1024, 16, precision="high").cuda()
    x = torch.randn(batch, 577, 1024, device="cuda")
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        block(x)
    small = x[:2].clone()
    del x
    gc.collect()
    torch.cuda.empty_cache()
    grad_y = torch.randn_like(small)
    errors = relative_errors(block_step(block, small, grad_y),
                             block_step_float64(block, small, grad_y))
    for name, error in zip(["y", "x", *dict(block.named_parameters())], errors):
        assert error < float32_grade_bound(name), (name, error)


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_module_out_of_memory_is_torch_out_of_memory_and_the_next_step_is_right(phase):
    """VisionAttentionBlock (float32, "high") at batch 40 with the allocator capped at
    what is allocated plus 64 MB (for the backward: after an uncapped forward): the
    forward or the backward raises torch.OutOfMemoryError (its activations alone, or
    grad_x, are larger), in a compile or in the run; uncapped, a step at that batch and at
    batch 3 is within the float32-grade bounds (1e-5 for y, 1e-3 for qkv.weight's one
    fp16 product, 1e-4 for the rest)."""
    torch.manual_seed(0)
    block = VisionAttentionBlock(1024, 16, precision="high").cuda()
    x = torch.randn(40, 577, 1024, device="cuda", requires_grad=True)
    grad_y = torch.randn_like(x)
    y = None if phase == "forward" else block(x)
    _capped_allocator(2 ** 26)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            if phase == "forward":
                block(x)
            else:
                y.backward(grad_y)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del y
    names = ["y", "x"] + [name for name, _ in block.named_parameters()]
    for batch in (40, 3):
        got = block_step(block, x[:batch], grad_y[:batch])
        errors = relative_errors(got, block_step_float64(block, x[:batch], grad_y[:batch]))
        for name, error in zip(names, errors):
            assert error < float32_grade_bound(name), (phase, batch, name, error)
