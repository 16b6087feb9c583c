"""On a CUDA GPU: a contract call that runs out of device memory, in a batch size's first
compile (autotuning included) or in its run, raises torch.OutOfMemoryError, and the next
calls, at that size and another, are right."""
import gc

import pytest
import torch

from vitattn_bwd import contract
from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs, within_tolerance

from .helpers import reference_grads

pytestmark = pytest.mark.gpu


def test_contract_out_of_memory_is_torch_out_of_memory_and_the_next_call_is_right():
    """The caching allocator is capped (for this test only) at what the inputs of a new
    batch size take plus 256 MB: far less than its compile and run need. (Garbage of
    earlier tests is collected first: freed during the call, it had made room under the
    cap.)"""
    gc.collect()
    torch.cuda.empty_cache()
    inputs = make_inputs(44, device="cuda")                   # not a benchmark size
    cap = (torch.cuda.memory_allocated() + 2 ** 28) / torch.cuda.get_device_properties(
        0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap)
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


def test_batch_times_heads_past_the_grid_is_refused_by_the_backward_and_the_block():
    """batch 4,096 x 16 heads (one token, so the tensors are small) is one past the
    attention kernels' grid: the contract's backward and VisionAttentionBlock refuse it
    at the call, naming x, before any kernel runs."""
    from vitattn_bwd import VisionAttentionBlock
    inputs = make_inputs(4096, seq_len=1, device="cuda")
    with pytest.raises(ValueError, match="x: batch 4096 x num_heads 16"):
        contract.run(*inputs.values())
    block = VisionAttentionBlock(1024, 16, precision="high").cuda()
    with pytest.raises(ValueError, match="x: batch 4096 x num_heads 16"):
        block(torch.randn(4096, 1, 1024, device="cuda"))
