"""The fused block as torch.library operators (block_ops.py) and VisionAttentionBlock
inside torch.compile, on the CPU: the operators' schema, fake implementations (shapes,
dtypes, contiguous strides, the empty batch) and autograd registration (opcheck); the
same results as the autograd.Function that eager calls use; and a compiled block
(fullgraph=True, no graph break) whose forward and backward are those operators in
float32 and the stock ops under bf16 autocast, matching eager and the float64 truth."""
import pytest
import torch

from vitattn_bwd import VisionAttentionBlock, block_ops, reference
from vitattn_bwd.module import VisionAttentionFunction
from vitattn_bwd.precision import fused_products

from .helpers import graph_breaks_and_ops, relative_errors

E, H, EPS = 16, 2, 1e-5
FWD = torch.ops.vitattn_bwd.vision_attention_fwd.default
BWD = torch.ops.vitattn_bwd.vision_attention_bwd.default
# the operators' checks without test_aot_dispatch_dynamic, which compiles our backward
# for several dynamic shapes (~30 s per case on the CPU); the compiled-block tests below
# run AOTAutograd on the operators instead
CHECKS = ("test_schema", "test_faketensor", "test_autograd_registration")


def _tensors(dtype, batch=2, tokens=5, requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, tokens, E), (E,), (E,), (3 * E, E), (3 * E,), (E, E), (E,))
    scales = (1.0, 1.0, 0.2, 0.25, 0.2, 0.25, 0.2)
    tensors = [(torch.randn(s, generator=g) * c + (1.0 if i == 1 else 0.0)).to(dtype)
               for i, (s, c) in enumerate(zip(shapes, scales))]
    return [t.requires_grad_(requires_grad) for t in tensors]


CASES = [(torch.float32, None), (torch.float64, None), (torch.float32, torch.bfloat16),
         (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


def _products(half_dtype):
    """The operators' products at precision "high" (one product in half_dtype if given)."""
    return fused_products("high", half_dtype)


@pytest.mark.parametrize("dtype,half_dtype", CASES)
@pytest.mark.parametrize("batch", [2, 0])
def test_forward_operator_passes_opcheck(dtype, half_dtype, batch):
    args = (*_tensors(dtype, batch), H, EPS, _products(half_dtype).value)
    torch.library.opcheck(FWD, args, test_utils=CHECKS)


@pytest.mark.parametrize("dtype,half_dtype", CASES)
@pytest.mark.parametrize("batch", [2, 0])
def test_backward_operator_passes_opcheck(dtype, half_dtype, batch):
    tensors = _tensors(dtype, batch, requires_grad=False)
    x, ln_weight, ln_bias, qkv_weight, _, out_weight, _ = tensors
    products = _products(half_dtype).value
    _, x_mean, x_var, qkv, lse, attn_output = FWD(*tensors, H, EPS, products)
    grad_y = torch.randn_like(x)
    args = (grad_y, x, x_mean, x_var, ln_weight, ln_bias, qkv_weight, qkv, lse,
            attn_output, out_weight, (E // H) ** -0.5, EPS, products)
    torch.library.opcheck(BWD, args, test_utils=CHECKS)


@pytest.mark.parametrize("dtype,half_dtype", CASES)
def test_real_outputs_are_what_the_fake_implementation_says(dtype, half_dtype):
    """Inductor lays out the code after an opaque operator by its fake outputs' strides:
    the real outputs are contiguous, of the fake's shapes and dtypes."""
    tensors = _tensors(dtype, requires_grad=False)
    products = _products(half_dtype).value
    real = FWD(*tensors, H, EPS, products)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = FWD(*(mode.from_tensor(t) for t in tensors), H, EPS, products)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
        assert r.is_contiguous()


@pytest.mark.parametrize("dtype,half_dtype", CASES)
def test_operators_compute_what_the_function_computes(dtype, half_dtype):
    """The same forward and backward, bit for bit (the same implementations)."""
    results = []
    for call in (VisionAttentionFunction.apply, block_ops.vision_attention):
        tensors = _tensors(dtype)
        y = call(*tensors, H, EPS, _products(half_dtype))
        grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
        results.append([y, *torch.autograd.grad(y, tensors, grad_y)])
    for ours, function in zip(*results):
        assert ours.dtype == function.dtype
        assert torch.equal(ours, function)


def _block(seed=0):
    torch.manual_seed(seed)
    block = VisionAttentionBlock(E, H)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return block


def _forward_backward(fn, block, x, grad_y):
    xg = x.detach().requires_grad_()
    y = fn(xg)
    grads = torch.autograd.grad(y, [xg, *block.parameters()], grad_y)
    return [y.detach(), *grads]


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_block_has_no_graph_break_and_matches_eager(autocast):
    """float32: the forward and backward are our operators in the user's graph;
    inside bf16 autocast (precision None): the stock ops, which Inductor compiles. Both
    compile with fullgraph=True and agree with eager (float32: within float32 rounding,
    and as close to the float64 truth; autocast: within bf16 rounding)."""
    block = _block()
    x = torch.randn(3, 7, E)
    grad_y = torch.randn(3, 7, E)
    region = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else \
        torch.enable_grad
    with region():
        breaks, ops = graph_breaks_and_ops(block, x)
    assert breaks == 0
    assert ops == (set() if autocast else
                                    {"vitattn_bwd.vision_attention_fwd"})
    compiled = torch.compile(block, fullgraph=True)
    with region():
        got = _forward_backward(compiled, block, x, grad_y)
        want = _forward_backward(block, block, x, grad_y)
    params = [p.detach().double().requires_grad_() for p in block.parameters()]
    x64 = x.double().requires_grad_()
    y64 = reference.block_forward(x64, *params, num_heads=H, eps=EPS)
    truth = [y64, *torch.autograd.grad(y64, [x64, *params], grad_y.double())]
    bound = 2e-2 if autocast else 1e-5
    for name, g, w, err in zip(["y", "x"] + [n for n, _ in block.named_parameters()],
                               got, want, relative_errors(got, want)):
        assert g.dtype == w.dtype, name
        assert err < bound, (name, err)
    # as close to float64 as eager (float32) or the stock block (autocast) is
    for name, ours, eager in zip(["y", "x"] + [n for n, _ in block.named_parameters()],
                                 relative_errors(got, truth), relative_errors(want, truth)):
        assert ours < 1.2 * eager + (0 if autocast else 1e-6), (name, ours, eager)


@pytest.mark.parametrize("precision,dtype,autocast", [
    ("medium", torch.float32, False),              # the one-product path on float32
    ("medium", torch.bfloat16, False),             # ... natively in a bf16 block
    ("high", torch.float32, True)])                # float32 math inside autocast
def test_compiled_fused_variants_are_the_operators_and_equal_eager(precision, dtype,
                                                                   autocast):
    """Every fused route runs as the operators inside torch.compile, bit for bit what
    the eager Function computes (the same implementations on the same inputs)."""
    block = _block().to(dtype)
    block.precision = precision
    x = torch.randn(3, 7, E).to(dtype)
    grad_y = torch.randn(3, 7, E).to(dtype)
    region = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else \
        torch.enable_grad
    with region():
        breaks, ops = graph_breaks_and_ops(block, x)
        got = _forward_backward(torch.compile(block, fullgraph=True), block, x, grad_y)
        want = _forward_backward(block, block, x, grad_y)
    assert breaks == 0
    assert ops == {"vitattn_bwd.vision_attention_fwd"}
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
