"""On the GPU: VisionAttentionBlock at precision "highest" at a batch whose split-GEMM
operands pass 2^31 elements (batch 1,850 at ViT-L/14-336: the QKV projection's output
[B*S, 3E] is 3.3e9 elements, grad_kv [B*S, 2E] 2.2e9), which the split GEMM's former
32-bit offsets refused. Checked against float64 per sample, on samples whose rows lie
past 2^31 elements, and for the weight gradients (sums over the whole batch) against a
float64 autograd run in chunks of the batch, each within 10x of the stock float32
block's own error (TF32 off).

Memory: the forward keeps x, y, qkv and the attention output (~27 GB at batch 1,850);
the backward's peak is larger; a device that cannot hold it skips the backward test
(torch.OutOfMemoryError), naming the batch. Compiles in VITATTN_BWD_COMPILE_MODE=default
take about a minute each; max-autotune several."""
import pytest
import torch

from vitattn_bwd import VisionAttentionBlock, contract, reference
from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs, within_tolerance

from .helpers import (block_step, block_step_float64, float32_grade_bound,
                      reference_grads, relative_error)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

SEQ, EMBED, HEADS = 577, 1024, 16
BATCH = 1850                    # B*S*2E = 2.19e9 >= 2^31
# samples to check one by one: the first, the first whose QKV rows pass 2^31 elements
# (row 2^31 / 3E = 699,051 is in sample 1,211), the first whose grad_kv rows do (row
# 2^31 / 2E = 1,048,576 is in sample 1,817), the last
SAMPLES = [0, 1211, 1817, BATCH - 1]
CHUNK = 50                      # float64 reference: P of 50 samples is 2.1 GB


def _block():
    torch.manual_seed(0)
    block = VisionAttentionBlock(EMBED, HEADS, precision="highest").cuda()
    with torch.no_grad():
        for p in block.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return block


def _stock_forward(block, x, dtype):
    params = [p.detach().to(dtype) for p in block.parameters()]
    return reference.block_forward(x.to(dtype), *params, num_heads=HEADS, eps=block.eps)


def _assert_samples_near_float64(block, x, y, samples, bound=None):
    """y (the block's output on x) on each of `samples` within `bound` of float64, or
    with bound None within 10x of the stock float32 block's own error against it."""
    for sample in samples:
        rows = slice(sample, sample + 1)
        want = _stock_forward(block, x[rows], torch.float64)
        if bound is None:
            stock = _stock_forward(block, x[rows], torch.float32)
            limit = 10 * relative_error(stock, want) + 1e-7
        else:
            limit = bound
        error = relative_error(y[rows], want)
        assert error < limit, (sample, error)


def test_no_grad_forward_past_2_31_elements():
    block = _block()
    x = torch.randn(BATCH, SEQ, EMBED, device="cuda")
    with torch.no_grad():
        _assert_samples_near_float64(block, x, block(x), SAMPLES)


def _chunked_grads(block, x, grad_y, dtype):
    """The stock block's grad_x on SAMPLES and its parameters' gradients over the whole
    batch, in `dtype`, by autograd over chunks of CHUNK samples."""
    params = [p.detach().to(dtype).requires_grad_() for p in block.parameters()]
    sums = [torch.zeros_like(p) for p in params]
    grad_x = {}
    for start in range(0, BATCH, CHUNK):
        xs = x[start:start + CHUNK].to(dtype).requires_grad_()
        ys = reference.block_forward(xs, *params, num_heads=HEADS, eps=block.eps)
        grads = torch.autograd.grad(ys, [xs, *params], grad_y[start:start + CHUNK].to(dtype))
        for total, g in zip(sums, grads[1:]):
            total += g
        for sample in SAMPLES:
            if start <= sample < start + CHUNK:
                grad_x[sample] = grads[0][sample - start]
    return grad_x, sums


def test_backward_past_2_31_elements():
    block = _block()
    x = torch.randn(BATCH, SEQ, EMBED, device="cuda").requires_grad_()
    grad_y = torch.randn(BATCH, SEQ, EMBED, device="cuda")
    try:
        y = block(x)
        grads = torch.autograd.grad(y, [x, *block.parameters()], grad_y)
    except torch.OutOfMemoryError as error:
        pytest.skip(f"batch {BATCH} does not fit this device's memory: {error}")
    del y
    grad_x, param_grads = grads[0].detach(), grads[1:]
    x = x.detach()
    truth_x, truth = _chunked_grads(block, x, grad_y, torch.float64)
    stock_x, stock = _chunked_grads(block, x, grad_y, torch.float32)
    for sample in SAMPLES:
        error = relative_error(grad_x[sample], truth_x[sample])
        assert error < 10 * relative_error(stock_x[sample], truth_x[sample]), (sample, error)
    names = [name for name, _ in block.named_parameters()]
    for name, got, want, ref in zip(names, param_grads, truth, stock):
        error = relative_error(got, want)
        assert error < 10 * relative_error(ref, want) + 1e-7, (name, error)


# ---- batch * heads past 65,535 (CUDA's cap on a grid's second dimension) -------------
# The attention kernels put batch * heads on the grid's first dimension; 4,100 x 16 heads
# is 65,600. 100 tokens give every head two or more blocks of rows, small tensors.
WIDE_BATCH, WIDE_SEQ = 4100, 100
WIDE_SAMPLES = [0, 4095, 4096, WIDE_BATCH - 1]     # either side of the former limit


def test_contract_past_65535_batch_heads_within_tolerance(monkeypatch):
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = make_inputs(WIDE_BATCH, seq_len=WIDE_SEQ, device="cuda", generator=generator)
    got = contract.run(*inputs.values())
    # float64 P of the whole batch and its gradients would not fit an 80 GB card
    refs = reference_grads(inputs, HEADS, "contract", device="cuda", chunk=1025)
    for name, out, ref in zip(OUTPUT_NAMES, got, refs):
        ok, matched = within_tolerance(out, ref)
        assert ok, (name, matched)


def test_block_past_65535_batch_heads_no_grad_and_step(monkeypatch):
    """VisionAttentionBlock (precision "high": bf16x3 products) at batch 4,100 x 16
    heads: the no_grad forward on samples either side of the former limit, and one
    step's outputs, within the float32-grade bounds against float64 (TF32 off)."""
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning
    block = VisionAttentionBlock(EMBED, HEADS, precision="high").cuda()
    x = torch.randn(WIDE_BATCH, WIDE_SEQ, EMBED, device="cuda")
    with torch.no_grad():
        _assert_samples_near_float64(block, x, block(x), WIDE_SAMPLES,
                                     bound=float32_grade_bound("y"))
    grad_y = torch.randn_like(x)
    got = block_step(block, x, grad_y)
    want = block_step_float64(block, x, grad_y)
    names = ["y", "x"] + [name for name, _ in block.named_parameters()]
    for name, out, ref in zip(names, got, want):
        assert relative_error(out, ref) < float32_grade_bound(name), name
