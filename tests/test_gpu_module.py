"""On a CUDA GPU (gpu marker): VisionAttentionBlock under torch.autocast (bf16, fp16; the
stock ops by default, the one-product path at "medium", float32 math with precision
"high") and
as a bf16/fp16 block against float64 autograd, float64 refused in the forward, empty
batches, double backward; and the Hugging Face swap (integrations.hf) of a CLIP vision
tower at ViT-L/14-336 size (577 tokens, 1024 wide, 16 heads) against the stock model:
outputs, gradients and 5 AdamW steps. float32 with TF32 off for torch's own matmuls and
convolutions (set per test and restored).

Bounds. Our backward is float32-grade (bf16x3), and at precision "high" the QKV weight
gradient one round-to-nearest fp16 product: per gradient ~1e-4 relative against float64
and ~1e-3 for the QKV weights (tests/test_gpu.py). (With TF32 off, torch's float32 matmul
precision is "highest", which precision None follows: fp16x3 split GEMMs with
two-level accumulation and an fp16x3 attention core, well inside those bounds.)
"""
import copy

import pytest
import torch

from vitattn_bwd import VisionAttentionBlock, reference

from .helpers import (adamw_losses, block_against_stock, block_step, block_step_float64,
                      float32_grade_bound, graph_breaks_and_ops, recorded_calls,
                      recorded_half_dtypes, relative_errors, update_difference)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

DEVICE = "cuda"
SEQ, EMBED, HEADS = 577, 1024, 16
# The HF tower: 336 px / 14 px patches = 24 x 24 patches + the class token = 577 tokens.
IMAGE, PATCH, LAYERS, MLP = 336, 14, 2, 4096
BATCH = 2                       # the backward's batch-2..15 graph, replayed as a CUDA graph


def _block(dtype=torch.float32, precision=None):
    torch.manual_seed(0)
    block = VisionAttentionBlock(EMBED, HEADS, precision=precision).to(DEVICE)
    with torch.no_grad():                   # LayerNorm and biases off their init
        for p in block.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return block.to(dtype)


UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}


def _check(block, x, grad_y, autocast_dtype=None):
    """Our y and gradients against float64; a result in bf16/fp16 may add the rounding
    of that dtype (one rounding of the float32 result, <= its unit roundoff)."""
    if autocast_dtype is None:
        got = block_step(block, x, grad_y)
    else:
        with torch.autocast(DEVICE, dtype=autocast_dtype):
            got = block_step(block, x, grad_y)
    want = block_step_float64(block, x, grad_y)
    names = ["y", "x"] + [n for n, _ in block.named_parameters()]
    sources = [x, x] + list(block.parameters())
    for name, g, src, err in zip(names, got, sources, relative_errors(got, want)):
        assert g.dtype == src.dtype, (name, g.dtype, src.dtype)
        bound = float32_grade_bound(name) + UNIT_ROUNDOFF[g.dtype]
        assert err < bound, (name, g.dtype, err, bound)
    return got[0]


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_precision_high_runs_in_float32_math(autocast_dtype):
    block = _block(precision="high")
    x = torch.randn(BATCH, SEQ, EMBED, device=DEVICE)
    grad_y = torch.randn_like(x)
    y = _check(block, x, grad_y, autocast_dtype)
    assert y.dtype == torch.float32
    # the stock block under the same autocast (bf16/fp16 GEMMs) is far less accurate,
    # so this test tells float32 math from half-precision math
    with torch.autocast(DEVICE, dtype=autocast_dtype), torch.no_grad():
        stock = reference.ReferenceBlock(block)(x)
    truth = block_step_float64(block, x, grad_y)[0]
    ours_err, stock_err = relative_errors([y, stock], [truth, truth])
    assert ours_err * 20 < stock_err, (ours_err, stock_err)


def _check_one_product_path(monkeypatch, block, x, half_dtype, grads_dtype, slack=0.0):
    """block's fused one-product path in half_dtype, run twice, against the stock block
    on the same x (each in the caller's autocast region, if any): both forwards took
    that path, the same bits twice, y and every gradient in grads_dtype, no further from
    float64 than the stock block's (plus `slack`) and within 4 unit roundoffs of it."""
    calls = recorded_half_dtypes(monkeypatch)
    got, again, _, errors = block_against_stock(block, x, torch.randn_like(x))
    assert calls == [half_dtype, half_dtype]
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    for name, g, w, ours, stock in errors:
        assert g.dtype == w.dtype == grads_dtype, (name, g.dtype, w.dtype)
        assert ours <= 1.1 * stock + slack, (name, ours, stock)
        assert ours < 4 * UNIT_ROUNDOFF[half_dtype], (name, ours)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_the_stock_ops_by_default(monkeypatch, autocast_dtype):
    """precision None under autocast: the stock ops (routing.py: our one-product path
    measured no faster there): the fused path is not taken, and the output and gradients
    are the stock block's, up to the order of torch's attention backward's atomic adds
    (cuDNN's and flash's dQ are not bitwise reproducible; on the H200 a bitwise
    comparison failed), within one unit roundoff of the half dtype."""
    calls = recorded_half_dtypes(monkeypatch)
    block = _block()
    x = torch.randn(BATCH, SEQ, EMBED, device=DEVICE)
    grad_y = torch.randn_like(x)
    with torch.autocast(DEVICE, dtype=autocast_dtype):
        got = block_step(block, x, grad_y)
        want = block_step(reference.ReferenceBlock(block), x, grad_y)
    assert calls == []
    for g, w, err in zip(got, want, relative_errors(got, want)):
        assert g.dtype == w.dtype and err < UNIT_ROUNDOFF[autocast_dtype], (g.dtype, err)


@pytest.mark.parametrize("batch", [BATCH, 16])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_precision_medium_runs_the_one_product_path(monkeypatch,
                                                                  autocast_dtype, batch):
    """precision "medium" under autocast: the fused one-product path in the autocast
    dtype (the attention core's one-product Gluon kernels; batch 2 through a CUDA graph,
    16 without), computing as the stock block does there: y in the stock block's dtype
    and as close to float64, every gradient in float32 and no further from float64 than
    the stock block's (whose GEMMs round the gradients to the half dtype), the same bits
    on a second call."""
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning
    block = _block(precision="medium")
    x = torch.randn(batch, SEQ, EMBED, device=DEVICE)
    with torch.autocast(DEVICE, dtype=autocast_dtype):
        _check_one_product_path(monkeypatch, block, x, autocast_dtype, torch.float32)


def test_precision_medium_is_one_bf16_product_per_matmul(monkeypatch):
    """precision="medium" outside autocast: the one-product path in bf16 on float32
    tensors: y and every gradient float32, within bf16's error of float64, and not
    float32 math (y further from float64 than bf16x3 gets)."""
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")
    calls = recorded_half_dtypes(monkeypatch)
    block = _block(precision="medium")
    x = torch.randn(BATCH, SEQ, EMBED, device=DEVICE)
    grad_y = torch.randn_like(x)
    got = block_step(block, x, grad_y)
    assert calls == [torch.bfloat16]
    errors = relative_errors(got, block_step_float64(block, x, grad_y))
    assert all(g.dtype == torch.float32 for g in got)
    assert max(errors) < 4 * UNIT_ROUNDOFF[torch.bfloat16] and errors[0] > 1e-4, errors


def test_autocast_keeps_no_more_memory_than_the_stock_block():
    """Under bf16 autocast at batch 8, the one-product path ("medium"): the peak memory
    of a forward and backward, above what was allocated before it, at most the stock
    block's."""
    block = _block(precision="medium")
    x = torch.randn(8, SEQ, EMBED, device=DEVICE)
    grad_y = torch.randn_like(x)
    peaks = []
    for model in (block, reference.ReferenceBlock(block), block):    # ours warm, then timed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            block_step(model, x, grad_y)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    assert peaks[2] <= peaks[1], peaks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_half_precision_input(dtype):
    block = _block(precision="high")
    x = torch.randn(BATCH, SEQ, EMBED, device=DEVICE).to(dtype)
    y = _check(block, x, torch.randn_like(x), dtype)
    assert y.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_block_with_precision_high_computes_in_float32(dtype):
    block = _block(dtype, precision="high")
    x = torch.randn(BATCH, SEQ, EMBED, device=DEVICE).to(dtype)
    grad_y = torch.randn_like(x)
    assert _check(block, x, grad_y).dtype == dtype
    block(x).backward(grad_y)
    assert all(p.grad.dtype == dtype for p in block.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_block_is_native_by_default(dtype):
    """precision None, input and parameters all bf16 (or fp16): the stock block's
    computation in that dtype, y bit for bit, the gradients in that dtype and within its
    rounding of the stock block's."""
    block = _block(dtype)
    x = torch.randn(BATCH, SEQ, EMBED, device=DEVICE).to(dtype)
    grad_y = torch.randn_like(x)
    got = block_step(block, x, grad_y)
    want = block_step(reference.ReferenceBlock(block), x, grad_y)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == w.dtype == dtype
        assert relative_errors([g], [w])[0] < 2 * UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [2, 16])
def test_precision_medium_runs_a_half_precision_block_natively(monkeypatch, dtype,
                                                               batch):
    """precision "medium", input and parameters all bf16 (or fp16): the fused one-product
    path in that dtype (no float32 copies; batch 2 through a CUDA graph, 16 without), as
    the stock block computes there: y and every gradient in that dtype, no further from
    float64 than the stock block's, the same bits on a second call."""
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning
    block = _block(dtype, precision="medium")
    x = torch.randn(batch, SEQ, EMBED, device=DEVICE).to(dtype)
    _check_one_product_path(monkeypatch, block, x, dtype, dtype,
                            slack=UNIT_ROUNDOFF[dtype] / 4)


def test_large_batch_compiled_forward_without_cuda_graphs(monkeypatch):
    """Batch 16 and up: the compiled forward and backward of the large bucket, run
    directly (no CUDA graph), float32-grade against float64."""
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning
    block = _block()
    torch.manual_seed(4)
    x = torch.randn(16, SEQ, EMBED, device=DEVICE)
    _check(block, x, torch.randn_like(x))


@pytest.mark.parametrize("order", ["eager_first", "eager_then_dynamo_reset", "compiled_first"])
def test_reduce_overhead_compile_at_a_graphed_batch(monkeypatch, order):
    """torch.compile(block, mode="reduce-overhead") at a batch our own CUDA graphs replay:
    after eager steps of the same block there, also after torch._dynamo.reset() (which
    drops our compiled graphs but not our CUDA graphs), or before any step at that
    signature. Inductor's CUDA graph trees warm up (our operators, meeting the signature
    new or stale there, run their compiled graphs directly: a capture of ours would
    leave memory in the trees' pool, which their checks refuse), then record a step
    with our operators inside (which must compile nothing: a compile fails the
    capture), then replay it; each step gives the eager step's bits."""
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning
    block = _block(precision="high")               # our operators at any batch
    torch.manual_seed(5)
    # a token count no other test meets: the compiled-first order meets it new
    seq = 321 if order == "compiled_first" else SEQ
    x = torch.randn(BATCH, seq, EMBED, device=DEVICE)
    grad_y = torch.randn_like(x)
    if order != "compiled_first":
        eager = block_step(block, x, grad_y)
    if order == "eager_then_dynamo_reset":
        torch._dynamo.reset()
    compiled = torch.compile(block, mode="reduce-overhead")
    steps = {}
    for step in ("warm-up", "record", "replay"):
        torch.compiler.cudagraph_mark_step_begin()
        steps[step] = [t.clone() for t in block_step(compiled, x, grad_y)]
    if order == "compiled_first":
        eager = block_step(block, x, grad_y)       # captures our CUDA graphs now
    for step, got in steps.items():
        assert all(torch.equal(g, e) for g, e in zip(got, eager)), step


def test_compiled_float32_training_at_two_images_and_high_runs_the_stock_ops(monkeypatch):
    """Inside torch.compile at torch's "high", a training step of at most
    routing.COMPILED_FLOAT32_STOCK_MAX_BATCH images traces the stock ops into the
    user's graph, and a larger one our operator; the compiled stock route's gradients
    are TF32-grade against float64."""
    from vitattn_bwd import routing
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning
    block = _block()
    torch.manual_seed(6)
    largest = routing.COMPILED_FLOAT32_STOCK_MAX_BATCH
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        breaks_and_ops = {batch: graph_breaks_and_ops(
                              block, torch.randn(batch, SEQ, EMBED, device=DEVICE))
                          for batch in (largest, largest + 1)}
        x = torch.randn(largest, SEQ, EMBED, device=DEVICE)
        grad_y = torch.randn_like(x)
        got = block_step(torch.compile(block), x, grad_y)
    finally:
        torch.set_float32_matmul_precision(before)
    assert breaks_and_ops == {largest: (0, set()),
                              largest + 1: (0, {"vitattn_bwd.vision_attention_fwd"})}
    names = ["y", "x"] + [n for n, _ in block.named_parameters()]
    errors = dict(zip(names, relative_errors(got, block_step_float64(block, x, grad_y))))
    assert all(err < 1e-2 for err in errors.values()), errors


def test_float64_is_refused_in_the_forward():
    block = _block().double()
    x = torch.randn(1, 9, EMBED, device=DEVICE, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match="float64 is not supported on cuda"):
        block(x)


def test_empty_batch_and_double_backward():
    block = _block()
    x = torch.randn(0, SEQ, EMBED, device=DEVICE, requires_grad=True)
    y = block(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is not None and not p.grad.any() for p in block.parameters())
    x = torch.randn(1, 17, EMBED, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"does not support double backward"):
        torch.autograd.grad(block(x).pow(2).sum(), x, create_graph=True)


# --- the Hugging Face swap at ViT-L/14-336 size ------------------------------------

def test_batch_one_on_autograd_thread_interleaved_with_main_thread_graphs(monkeypatch):
    """Batch 1 runs as CUDA graphs (cuda_graphs.py): the module's forward on the main
    thread and its backward on autograd's thread, contract.run's backward on the main
    thread. Ten steps interleaved with contract.run at batch 1 give bitwise-equal
    gradients, within the float32-grade bounds against float64, and graphs were replayed
    on both threads."""
    import threading
    from vitattn_bwd import cuda_graphs
    # per replay: whether it ran on the main thread
    replays = recorded_calls(
        monkeypatch, cuda_graphs._Captured, "replay",
        lambda self, inputs: threading.current_thread() is threading.main_thread())
    from vitattn_bwd import contract
    from vitattn_bwd.workloads import make_inputs
    block = _block()
    torch.manual_seed(3)
    x = torch.randn(1, SEQ, EMBED, device=DEVICE)
    grad_y = torch.randn_like(x)
    contract_args = tuple(make_inputs(1, device=DEVICE).values())
    first = block_step(block, x, grad_y)
    contract_first = contract.run(*contract_args)
    for _ in range(9):
        got = block_step(block, x, grad_y)
        assert all(torch.equal(a, b) for a, b in zip(got, first))
        assert all(torch.equal(a, b) for a, b in zip(contract.run(*contract_args),
                                                     contract_first))
    names = ["y", "x"] + [n for n, _ in block.named_parameters()]
    for name, err in zip(names, relative_errors(first, block_step_float64(block, x, grad_y))):
        assert err < float32_grade_bound(name), (name, err)
    # 10 calls each of the module's forward and contract.run (main thread) and of the
    # module's backward (autograd's thread), each a replay (a first call too)
    assert replays.count(True) == 20 and replays.count(False) == 10, replays


# A fresh process: Inductor's CUDA graph trees set up their thread-local state on the
# thread that first imports them; on torch 2.11, first imported on autograd's thread,
# they crash the next garbage collection on the main thread (docs/repro/README.md).
_FIRST_STEP_IN_A_FRESH_PROCESS = """
import sys
import torch
from vitattn_bwd import VisionAttentionBlock
trees = "torch._inductor.cudagraph_trees"
before = trees in sys.modules
block = VisionAttentionBlock(64, 2).cuda()
x = torch.randn(1, 9, 64, device="cuda", requires_grad=True)
block(x).sum().backward()
torch.cuda.synchronize()
assert torch.isfinite(x.grad).all()
print("trees imported before:", before, "after:", trees in sys.modules)
"""


def test_first_module_step_does_not_import_cuda_graph_trees():
    """The module's first batch-1 step (a CUDA graph replayed on autograd's thread)
    leaves Inductor's CUDA graph trees unimported, unless the main thread had already
    imported them."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, VITATTN_BWD_COMPILE_MODE="default")
    # the GPU memory this process's allocator caches from earlier tests given back for
    # the child: on an 80 GB H100 the child failed after the margin properties (batch 56)
    # and passed alone (suspected: out of memory; its error was cut off)
    torch.cuda.empty_cache()
    child = subprocess.run([sys.executable, "-c", _FIRST_STEP_IN_A_FRESH_PROCESS],
                           env=env, capture_output=True, text=True, timeout=300)
    # the error's head and tail (Inductor's graph dump lies between them)
    assert child.returncode == 0, child.stderr[:2000] + "\n...\n" + child.stderr[-2000:]
    line = child.stdout.strip().splitlines()[-1]
    assert line in ("trees imported before: False after: False",
                    "trees imported before: True after: True"), line


def _towers(precision=None):
    transformers = pytest.importorskip("transformers")
    from vitattn_bwd.integrations.hf import swap_attention, swapped_layers
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(
        hidden_size=EMBED, intermediate_size=MLP, num_attention_heads=HEADS,
        num_hidden_layers=LAYERS, image_size=IMAGE, patch_size=PATCH,
        hidden_act="quick_gelu")
    stock = transformers.CLIPVisionModel(config).to(DEVICE).eval()
    with torch.no_grad():           # LayerNorm weights and biases off 1 and 0
        for name, p in stock.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    ours = swap_attention(copy.deepcopy(stock), precision=precision)
    assert len(swapped_layers(ours)) == LAYERS
    return stock, ours


def _batch(seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, device=DEVICE, generator=g)
    weight = torch.randn(BATCH, SEQ, EMBED, device=DEVICE, generator=g)
    return pixels, weight


def _loss(model, pixels, weight):
    out = model(pixel_values=pixels.to(next(model.parameters()).dtype))
    return ((out.last_hidden_state * weight).sum() + out.pooler_output.pow(2).sum(),
            out.last_hidden_state)


def _grads(model, pixels, weight):
    model.zero_grad(set_to_none=True)
    loss, hidden = _loss(model, pixels, weight)
    loss.backward()
    return hidden.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _errors(got, want):
    """Relative error per gradient; k_proj.bias has no gradient in exact math (softmax
    ignores a constant added to all keys), so its error is taken against the norm of its
    layer's q/k/v bias gradients."""
    errors = {}
    for name, g in got.items():
        denom = want[name].double().norm()
        if name.endswith("k_proj.bias"):
            layer = name[:-len("k_proj.bias")]
            denom = torch.cat([want[layer + p + "_proj.bias"].double() for p in "qkv"]).norm()
        errors[name] = ((g.double() - want[name].double()).norm() / denom).item()
    return errors


def _hf_bound(name):
    # one fused backward (1e-4, TF32 QKV weights 1e-3) plus the gradient error that the
    # layer above hands down through grad_x (<= 1e-4): 2e-4 for all but the q/k/v weights
    if any(name.endswith(p + "_proj.weight") for p in "qkv"):
        return 1e-3
    return 2e-4


def test_hf_vit_l14_336_outputs_and_gradients_against_the_stock_model():
    stock, ours = _towers()
    stock64 = copy.deepcopy(stock).double()
    pixels, weight = _batch(0)
    hidden64, grads64 = _grads(stock64, pixels, weight.double())
    hidden_stock, grads_stock = _grads(stock, pixels, weight)
    hidden_ours, grads_ours = _grads(ours, pixels, weight)
    ours_err, stock_err = relative_errors([hidden_ours, hidden_stock], [hidden64, hidden64])
    # forward: bf16x3 projections (~4e-6 a layer) against SDPA float32 (~1e-6)
    assert ours_err < 1e-5 and stock_err < 1e-5, (ours_err, stock_err)
    assert relative_errors([hidden_ours], [hidden_stock])[0] < 1e-5
    errors, stock_errors = _errors(grads_ours, grads64), _errors(grads_stock, grads64)
    report = {n: f"{errors[n]:.1e} (stock {stock_errors[n]:.1e})" for n in errors}
    print("gradient errors vs float64:", report)
    for name, err in errors.items():
        assert err < _hf_bound(name), (name, report[name])


def test_hf_vit_l14_336_highest_against_float32s_own_error():
    """precision "highest" against the stock float32 tower's own error (both against
    float64): the output within 5x of it, every gradient within 10x (issue 24), and the
    q/k/v weight gradients over 5x closer than "high"'s, whose one fp16 product puts
    them at ~2e2x. Measured in a 4-layer tower (scripts/bench_towers.py --suite accuracy): output 1.2x,
    gradients up to 8.3x (the k_proj biases, zero in exact math; the rest up to 5x),
    bounded by the fp16x3 attention core's ~2e-6 (docs/performance.md, sessions 13 and
    14: the same with float32 SGEMMs and with the split GEMMs)."""
    stock, highest = _towers("highest")
    _, high = _towers("high")
    pixels, weight = _batch(0)
    hidden64, grads64 = _grads(copy.deepcopy(stock).double(), pixels, weight.double())
    results = {name: _grads(model, pixels, weight)
               for name, model in (("stock", stock), ("highest", highest), ("high", high))}
    output_errors = {name: relative_errors([hidden], [hidden64])[0]
                     for name, (hidden, _) in results.items()}
    errors = {name: _errors(grads, grads64) for name, (_, grads) in results.items()}
    ratios = {n: errors["highest"][n] / errors["stock"][n] for n in errors["stock"]}
    print("output errors vs float64:", output_errors)
    print("highest / stock float32, worst:",
          sorted(ratios.items(), key=lambda item: -item[1])[:4])
    assert output_errors["highest"] < 5 * output_errors["stock"], output_errors
    assert all(ratio < 10 for ratio in ratios.values()), ratios
    for name in errors["stock"]:
        if any(name.endswith(p + "_proj.weight") for p in "qkv"):
            assert errors["highest"][name] * 5 < errors["high"][name], (
                name, errors["highest"][name], errors["high"][name])


def test_hf_vit_l14_336_in_bfloat16_at_medium_against_the_stock_bfloat16_model():
    """A `.bfloat16()` tower swapped with precision "medium": every attention half on the
    native one-product path in bf16, the output and the gradients in bf16 and as close
    to the float64 tower as the stock bf16 tower's (within a quarter of bf16's unit
    roundoff more)."""
    stock, ours = _towers("medium")
    stock64 = copy.deepcopy(stock).double()
    stock, ours = stock.bfloat16(), ours.bfloat16()
    pixels, weight = _batch(0)
    hidden64, grads64 = _grads(stock64, pixels, weight.double())
    hidden_stock, grads_stock = _grads(stock, pixels, weight.bfloat16())
    hidden_ours, grads_ours = _grads(ours, pixels, weight.bfloat16())
    assert hidden_ours.dtype == torch.bfloat16
    assert all(g.dtype == torch.bfloat16 for g in grads_ours.values())
    ours_err, stock_err = relative_errors([hidden_ours, hidden_stock], [hidden64, hidden64])
    assert ours_err <= 1.1 * stock_err + UNIT_ROUNDOFF[torch.bfloat16] / 4, (ours_err,
                                                                             stock_err)
    errors, stock_errors = _errors(grads_ours, grads64), _errors(grads_stock, grads64)
    report = {n: f"{errors[n]:.1e} (stock {stock_errors[n]:.1e})" for n in errors}
    print("bf16 gradient errors vs float64:", report)
    for name, err in errors.items():
        assert err <= 1.1 * stock_errors[name] + UNIT_ROUNDOFF[torch.bfloat16] / 4, (
            name, report[name])


def test_hf_vit_l14_336_five_adamw_steps_track_the_stock_model():
    stock, ours = _towers()
    start = {n: p.detach().clone() for n, p in stock.named_parameters()}

    def regression(model, pixels, weight):
        """Positive and O(1): no cancellation in the comparison."""
        out = model(pixel_values=pixels)
        return (((out.last_hidden_state - weight) ** 2).mean()
                + out.pooler_output.pow(2).mean())
    losses = {key: adamw_losses(model, regression, lambda step: _batch(10 + step), 5,
                                lr=1e-4)
              for key, model in (("stock", stock), ("ours", ours))}
    # losses: the forward's ~1e-6 plus the effect of slightly different updates
    for a, b in zip(losses["ours"], losses["stock"]):
        assert abs(a - b) <= 1e-4 * abs(b), (losses["ours"], losses["stock"])
    assert losses["ours"][-1] < losses["ours"][0], losses["ours"]       # it trains
    # updates: AdamW's first step is lr * sign(gradient), so the two models' updates
    # differ only where a gradient entry is smaller than its error and flips sign: with
    # errors ~1e-4 (TF32 QKV weights ~4e-4) of a gradient's rms, a few 1e-4 of the entries,
    # each by 2 lr, i.e. ~sqrt(4 * 3e-4) ~ 0.04 of the update's norm; later steps alike.
    # k_proj.bias is left out: its exact gradient is zero, so its updates are noise.
    rel, _ = update_difference(ours, stock, start, skip=("k_proj.bias",))
    print(f"AdamW: losses ours {losses['ours']} stock {losses['stock']}; "
          f"update difference {rel:.3e} of the update")
    assert rel < 0.2, rel
