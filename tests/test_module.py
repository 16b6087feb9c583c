"""VisionAttentionBlock on the CPU: its fused backward against autograd through a plain
block, gradcheck, training steps, torch.compile, the weight converters, argument checks
at construction, empty batches, double backward, autocast and bf16/fp16 blocks. (DDP:
tests/test_distributed.py.)"""
import contextlib
import copy

import pytest
import torch
from torch import nn

from vitattn_bwd import VisionAttentionBlock, reference
from vitattn_bwd.precision import Products
from vitattn_bwd.module import (CLIP_KEYS, MOLMO_KEYS, VisionAttentionFunction,
                                vision_attention)

from .helpers import block_step, block_step_float64, relative_errors


def _grads(model, x, grad_y):
    x = x.detach().requires_grad_()
    y = model(x)
    return [y] + list(torch.autograd.grad(y, [x, *model.parameters()], grad_y))


def _randomize(block, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return block


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_gradients_equal_autograd_of_plain_block(dtype, bound):
    block = _randomize(VisionAttentionBlock(32, 4, dtype=dtype))
    x = torch.randn(3, 13, 32, dtype=dtype)
    grad_y = torch.randn(3, 13, 32, dtype=dtype)
    ours = _grads(block, x, grad_y)
    ref_block = copy.deepcopy(block).double()
    want = _grads(reference.ReferenceBlock(ref_block), x.double(), grad_y.double())
    for name, err in zip(["y", "x"] + [n for n, _ in block.named_parameters()],
                         relative_errors(ours, want)):
        assert err < bound, (name, err)


def _layouts(values):
    """values [B,S,E] in ten memory layouts: row-major, transposed, permuted, sliced,
    and broadcast along the batch or the tokens (values[:1] / [:, :1] there)."""
    B, S, E = values.shape
    wide = torch.zeros(B, S, 2 * E)
    wide[..., ::2] = values
    tall = torch.zeros(B, 2 * S, E)
    tall[:, ::2] = values
    return [values, values.transpose(0, 1).contiguous().transpose(0, 1),
            values.transpose(1, 2).contiguous().transpose(1, 2),
            values.permute(2, 1, 0).contiguous().permute(2, 1, 0),
            values.permute(1, 2, 0).contiguous().permute(2, 0, 1), wide[..., ::2],
            tall[:, ::2], values[:1].expand(B, S, E), values[:, :1].expand(B, S, E),
            values[:1, :1].expand(B, S, E)]


def test_inputs_in_any_layout_train_like_float64():
    """x in ten layouts, one after another into one block: each call's output and
    gradients as float64 autograd's (every layout once compiled a graph of its own,
    and the ninth raised dynamo's recompile limit in the backward)."""
    block = _randomize(VisionAttentionBlock(16, 2))
    for index, x in enumerate(_layouts(torch.randn(2, 5, 16))):
        grad_y = torch.randn(2, 5, 16)
        errors = relative_errors(block_step(block, x, grad_y),
                                 block_step_float64(block, x, grad_y))
        assert max(errors) < 1e-5, (index, x.stride(), errors)


@pytest.mark.parametrize("precision", [None, "highest"])
def test_torch_func_grad_and_vmap_give_autograds_gradients(precision):
    """torch.func.grad of a functional_call, and per-sample gradients by vmap of it (the
    stock ops run under the transforms: our autograd.Function has no functorch rules,
    and raised torch's error): the gradients ordinary autograd gives the block."""
    block = _randomize(VisionAttentionBlock(16, 2, dtype=torch.float64, precision=precision))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    params = {name: p.detach() for name, p in block.named_parameters()}

    def loss(params, x):
        return torch.func.functional_call(block, params, (x,)).square().sum()
    got = torch.func.grad(loss)(params, x)
    want = torch.autograd.grad(block(x).square().sum(), list(block.parameters()))
    for (name, g), w in zip(got.items(), want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(
        params, x.unsqueeze(1))                                      # [B,1,S,E] samples
    for index in range(x.shape[0]):
        want = torch.autograd.grad(block(x[index:index + 1]).square().sum(),
                                   list(block.parameters()))
        for (name, g), w in zip(per_sample.items(), want):
            torch.testing.assert_close(g[index], w, rtol=1e-10, atol=1e-12, msg=name)


def test_gradcheck_on_a_tiny_block():
    block = _randomize(VisionAttentionBlock(8, 2, dtype=torch.float64))
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in block.parameters()]
    assert torch.autograd.gradcheck(
        lambda x, *p: VisionAttentionFunction.apply(x, *p, 2, 1e-5), (x, *params))


def _tower(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(VisionAttentionBlock(16, 2, dtype=dtype),
                         VisionAttentionBlock(16, 2, dtype=dtype))


def _train(model, steps=5):
    torch.manual_seed(1)
    x, target = torch.randn(4, 7, 16, dtype=torch.float64), torch.randn(4, 7, 16,
                                                                        dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_block_tower_trains_like_the_plain_model():
    ours = _train(_tower())
    plain_tower = _tower()
    plain = _train(nn.Sequential(*(reference.ReferenceBlock(b) for b in plain_tower)))
    assert ours[-1] < ours[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(plain), rtol=1e-10, atol=0)


def test_block_inside_torch_compile():
    model = _tower(torch.float32)
    x = torch.randn(2, 9, 16)
    eager = _grads(model, x, torch.ones(2, 9, 16))
    compiled = _grads(torch.compile(model), x, torch.ones(2, 9, 16))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_block_inside_torch_compile_with_dynamic_shapes_in_one_graph():
    """torch.compile(dynamic=True, fullgraph=True): the block's eps is then a symbolic
    float, which the checks compare rather than pass to math.isfinite (dynamo cannot
    trace it there); each batch size runs in the one graph, as the eager block."""
    model = _tower(torch.float32)
    compiled = torch.compile(model, dynamic=True, fullgraph=True)
    for batch in (2, 3, 5):
        x = torch.randn(batch, 9, 16)
        eager = _grads(model, x, torch.ones(batch, 9, 16))
        for a, b in zip(_grads(compiled, x, torch.ones(batch, 9, 16)), eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_backward_leaves_the_callers_tensors_static():
    """The compiled backward marks its inputs' batch dimension dynamic: its own alias of
    each, never the caller's x (saved as it is) or the gradient given to backward, whose
    batch would then be dynamic in the caller's own torch.compile graphs too."""
    model = VisionAttentionBlock(16, 2)
    x = torch.randn(2, 9, 16, requires_grad=True)
    grad = torch.randn(2, 9, 16)
    model(x).backward(grad)
    for t in (x, grad):
        assert not getattr(t, "_dynamo_dynamic_indices", set())
    # a caller's fullgraph compile specializing on that batch still compiles
    double_if_two = torch.compile(lambda t: t * 2 if t.shape[0] == 2 else t, fullgraph=True)
    torch.testing.assert_close(double_if_two(x.detach()), 2 * x.detach())


def _source_state_dict(key_map, prefix, E=16):
    g = torch.Generator().manual_seed(3)
    state = {"unrelated.weight": torch.zeros(1)}
    for theirs in key_map.values():
        for key in theirs:
            rows = E if ("weight" in key or "bias" in key) else None
            shape = (rows, E) if key.endswith("weight") and "norm" not in key else (rows,)
            state[prefix + key] = torch.randn(*shape, generator=g)
    return state


@pytest.mark.parametrize("convention", ["molmo", "clip"])
def test_state_dict_converters(convention):
    key_map = MOLMO_KEYS if convention == "molmo" else CLIP_KEYS
    state = _source_state_dict(key_map, "layers.0.")
    block = VisionAttentionBlock(16, 2)
    getattr(block, f"load_{convention}_state_dict")(state, prefix="layers.0.")
    q, k, v = key_map["qkv.weight"]
    torch.testing.assert_close(block.qkv.weight[16:32], state["layers.0." + k])
    torch.testing.assert_close(block.qkv.weight[32:], state["layers.0." + v])
    torch.testing.assert_close(block.norm.bias, state["layers.0." + key_map["norm.bias"][0]])
    torch.testing.assert_close(block.out_proj.weight,
                               state["layers.0." + key_map["out_proj.weight"][0]])
    del state["layers.0." + q]
    with pytest.raises(KeyError, match=q):
        getattr(block, f"load_{convention}_state_dict")(state, prefix="layers.0.")


def test_wrong_input_shape_is_rejected():
    with pytest.raises(ValueError, match="x must be"):
        VisionAttentionBlock(16, 2)(torch.randn(2, 5, 8))


@pytest.mark.parametrize("args,error,match", [
    ((32, 0), ValueError, "num_heads must be positive"),
    ((32, -2), ValueError, "num_heads must be positive"),
    ((32, 5), ValueError, "num_heads=5 must divide embed_dim=32"),
    ((32, 2.0), TypeError, "num_heads must be an int"),
    ((32, True), TypeError, "num_heads must be an int"),
    ((0, 1), ValueError, "embed_dim must be positive"),
    ((-4, 2), ValueError, "embed_dim must be positive"),
    ((32.0, 2), TypeError, "embed_dim must be an int"),
    ((32, 2, -1e-5), ValueError, "eps must be finite and >= 0"),
    ((32, 2, float("nan")), ValueError, "eps must be finite and >= 0"),
    ((32, 2, float("inf")), ValueError, "eps must be finite and >= 0"),
    ((32, 2, "1e-5"), TypeError, "eps must be a float"),
])
def test_bad_configuration_is_refused_at_construction(args, error, match):
    with pytest.raises(error, match=match):
        VisionAttentionBlock(*args)


def test_eps_zero_is_accepted_and_used():
    block = _randomize(VisionAttentionBlock(16, 2, eps=0, dtype=torch.float64))
    assert block.eps == 0.0 and isinstance(block.eps, float)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    want = reference.ReferenceBlock(block)(x)
    torch.testing.assert_close(block(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("set_on", ["norm", "block"])
def test_eps_set_after_construction_is_used(set_on):
    """block.norm.eps and block.eps are one value, read at each call: set on either
    after construction (a config edit), the block computes with it (it kept the
    constructor's before)."""
    block = _randomize(VisionAttentionBlock(16, 2, eps=1e-5, dtype=torch.float64))
    setattr(block.norm if set_on == "norm" else block, "eps", 0.5)
    assert block.eps == block.norm.eps == 0.5
    x = torch.randn(2, 5, 16, dtype=torch.float64) * 0.1
    params = [p.detach() for p in (block.norm.weight, block.norm.bias, block.qkv.weight,
                                   block.qkv.bias, block.out_proj.weight, block.out_proj.bias)]
    want = reference.block_forward(x, *params, num_heads=2, eps=0.5)
    torch.testing.assert_close(block(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,precision", [(torch.float64, None),
                                             (torch.float32, "medium"),
                                             (torch.bfloat16, "medium")])
@pytest.mark.parametrize("shape", [(0, 7, 16), (3, 0, 16)])
def test_empty_batch_behaves_like_the_stock_block(shape, dtype, precision):
    """The fused path (float32-grade, and the one-product path on float32 and natively
    on a bf16 block, whose empty forward runs no kernel) gives an empty y and zero
    gradients, as the stock block does."""
    block = _randomize(VisionAttentionBlock(16, 2, dtype=dtype, precision=precision))
    stock = reference.ReferenceBlock(copy.deepcopy(block))
    results = []
    for model in (block, stock):
        x = torch.randn(*shape, dtype=dtype, requires_grad=True)
        y = model(x)
        assert y.shape == shape
        y.sum().backward()
        assert x.grad.shape == shape
        results.append([p.grad for p in model.parameters()])
    for (name, p), ours, theirs in zip(block.named_parameters(), *results):
        assert ours is not None and theirs is not None, name
        assert ours.shape == p.shape, name
        assert torch.equal(ours, theirs) and not ours.any(), name     # all zeros


def test_double_backward_raises_a_clear_error():
    block = _randomize(VisionAttentionBlock(16, 2, dtype=torch.float64))
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"does not support double backward "
                                           r"\(create_graph=True\)"):
        torch.autograd.grad(block(x).pow(2).sum(), x, create_graph=True)
    # and a plain backward still works afterwards
    (g,) = torch.autograd.grad(block(x).pow(2).sum(), x)
    x_ref = x.detach().requires_grad_()
    (want,) = torch.autograd.grad(reference.ReferenceBlock(block)(x_ref).pow(2).sum(), x_ref)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)


def test_second_derivatives_as_the_double_backward_error_advises():
    """torch.func.grad of torch.func.grad runs the block's stock ops, and with SDPA's math
    backend gives the second derivative of the stock block's math (the advice of the
    double-backward error)."""
    from torch.func import functional_call, grad
    from torch.nn.attention import SDPBackend, sdpa_kernel
    block = _randomize(VisionAttentionBlock(16, 2, dtype=torch.float64))
    params = dict(block.named_parameters())
    x = torch.randn(2, 5, 16, dtype=torch.float64)

    def curvature(forward):
        def loss(x):
            return forward(x).pow(3).sum()
        return grad(lambda x: grad(loss)(x).pow(2).sum())(x)
    with sdpa_kernel(SDPBackend.MATH):
        got = curvature(lambda x: functional_call(block, params, (x,)))
        want = curvature(lambda x: reference.block_forward(
            x, *(p.detach() for p in params.values()), num_heads=2, eps=block.eps))
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _check_against_truth(block, x, grad_y, bounds):
    """bounds: dtype of the tensor (y, x's gradient, a parameter's gradient) -> bound on
    its relative error against float64 autograd."""
    got = block_step(block, x, grad_y)
    want = block_step_float64(block, x, grad_y)
    names = ["y", "x"] + [n for n, _ in block.named_parameters()]
    sources = [x, x] + list(block.parameters())
    for name, g, src, err in zip(names, got, sources, relative_errors(got, want)):
        assert g.dtype == src.dtype, (name, g.dtype, src.dtype)
        assert err < bounds[g.dtype], (name, g.dtype, err)
    return got[0]


# A float32 result is float32 math (1e-5, as in the test above); a bf16 / fp16 result is
# float32 math rounded once to its dtype: a relative error of at most the unit roundoff
# (2^-8 = 3.9e-3 for bf16, 2^-11 = 4.9e-4 for fp16) per element, hence in norm.
ROUNDED_ONCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_autocast_with_precision_high_runs_in_float32_math(x_dtype):
    block = _randomize(VisionAttentionBlock(32, 4, precision="high"))
    x = torch.randn(3, 13, 32).to(x_dtype)
    grad_y = torch.randn(3, 13, 32).to(x_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _check_against_truth(block, x, grad_y, ROUNDED_ONCE)
        assert y.dtype == x_dtype            # the residual stream keeps its dtype
        # the stock block under autocast (bf16 matmuls) is much less accurate: this test
        # tells float32 math from bf16 math (with a bf16 y both are bf16 rounding-bound)
        stock = reference.ReferenceBlock(block)(x)
    if x_dtype == torch.float32:
        truth = block_step_float64(block, x, grad_y)[0]
        ours_err, stock_err = relative_errors([y, stock], [truth, truth])
        assert ours_err * 100 < stock_err, (ours_err, stock_err)


def _saved_bytes(fn, parameters=()):
    """fn()'s result and the bytes of the tensors autograd saved for its backward, but
    for `parameters` themselves (which the model holds anyway)."""
    saved = []
    owned = {p.data_ptr() for p in parameters}

    def pack(t):
        if t.data_ptr() not in owned:
            saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(saved)


def _ours_and_stock(block, x, grad_y, autocast):
    """[(y, gradients of x and of the parameters, bytes saved for the backward)] of
    `block` and of the stock block on its parameters, each forward inside a CPU bf16
    autocast region if `autocast`."""
    region = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else \
        contextlib.nullcontext
    results = []
    for model in (block, reference.ReferenceBlock(block)):
        xg = x.detach().requires_grad_()
        with region():
            y, saved = _saved_bytes(lambda: model(xg), block.parameters())  # noqa: B023
        results.append((y, torch.autograd.grad(y, [xg, *block.parameters()], grad_y),
                        saved))
    return results


def test_autocast_runs_the_stock_ops_by_default(monkeypatch):
    """Under autocast, precision None computes with the stock ops (routing.py: our
    one-product path measured no faster there): no fused call, the stock block's output
    and gradients bit for bit, the same saved activations."""
    calls = _recorded_precisions(monkeypatch)
    block = _randomize(VisionAttentionBlock(32, 4))
    x = torch.randn(3, 13, 32)
    grad_y = torch.randn(3, 13, 32)
    (y, grads, saved), (want_y, want_grads, want_saved) = _ours_and_stock(
        block, x, grad_y, autocast=True)
    assert calls == []
    assert y.dtype == want_y.dtype == torch.float32
    assert saved == want_saved
    assert torch.equal(y, want_y)
    assert all(torch.equal(g, want) for g, want in zip(grads, want_grads))


def test_autocast_with_precision_medium_runs_the_one_product_path(monkeypatch):
    """Under autocast, precision "medium" computes as the stock LayerNorm + Linear +
    SDPA block does there (one bf16 product per matmul, float32 accumulation, the
    LayerNorm and softmax statistics in float32), on the fused one-product path: the
    output dtype of the stock block, an output as close to float64 as the stock one, no
    gradient further from float64 than the stock block's (ours leave their GEMMs in
    float32 where autocast rounds them to bf16), fewer bytes saved for the backward,
    the projections and the attention output saved in bf16. The errors are summed over
    8 seeded draws: one draw's LayerNorm weight gradient (a sum over 39 rows) ranged
    0.72-1.07x stock's over 24 seeds, and 1.41x in an unseeded draw, where the sums over
    24 seeds are 0.76x."""
    calls = _recorded_precisions(monkeypatch)
    names = ["y", "x"] + [n for n, _ in VisionAttentionBlock(32, 4).named_parameters()]
    ours_sums, stock_sums = [0.0] * len(names), [0.0] * len(names)
    for seed in range(8):
        torch.manual_seed(seed)
        block = _randomize(VisionAttentionBlock(32, 4, precision="medium"))
        x = torch.randn(3, 13, 32)
        grad_y = torch.randn(3, 13, 32)
        (y, grads, saved), (want_y, want_grads, want_saved) = _ours_and_stock(
            block, x, grad_y, autocast=True)
        assert y.dtype == want_y.dtype == torch.float32
        assert saved < want_saved, (saved, want_saved)
        for name, g, src in zip(names, [y, *grads], [x, x, *block.parameters()]):
            assert g.dtype == src.dtype, (name, g.dtype)
        truth = block_step_float64(block, x, grad_y)
        ours_errors = relative_errors([y, *grads], truth)
        stock_errors = relative_errors([want_y, *want_grads], truth)
        ours_sums = [a + b for a, b in zip(ours_sums, ours_errors)]
        stock_sums = [a + b for a, b in zip(stock_sums, stock_errors)]
        # bf16 math, not float32 math: far from the float64 truth, like the stock block
        assert ours_errors[0] > 1e-3
    assert calls == [["torch.bfloat16", "torch.bfloat16"]] * 8
    for name, ours, stock in zip(names, ours_sums, stock_sums):
        assert ours <= 1.1 * stock, (name, ours, stock)
    block.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, saved_dtypes = _saved_dtypes(lambda: block(x))
    assert saved_dtypes.count(torch.bfloat16) == 2       # the QKV projection, attn_output


def test_autocast_with_precision_medium_follows_the_autocast_dtype(monkeypatch):
    """"medium" inside an fp16 autocast region: the one-product path in fp16."""
    calls = _recorded_precisions(monkeypatch)
    block = _randomize(VisionAttentionBlock(32, 4, precision="medium"))
    x = torch.randn(2, 5, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        y = block(x)
    y.sum().backward()
    assert calls == [["torch.float16", "torch.float16"]]
    assert y.dtype == torch.float32 and x.grad.dtype == torch.float32


def _saved_dtypes(fn):
    """fn()'s result and the dtypes of the tensors autograd saved for its backward."""
    dtypes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.append(t.dtype) or t,
                                                  lambda t: t):
        result = fn()
    return result, dtypes


def test_autocast_with_half_precision_input_follows_the_stock_block():
    """A bf16 input into a float32 block under autocast (mixed dtypes, which the
    one-product path does not take) computes with the stock ops: the same output, bit
    for bit, the same gradients, the same saved activations."""
    block = _randomize(VisionAttentionBlock(32, 4))
    x = torch.randn(3, 13, 32).bfloat16()
    grad_y = torch.randn(3, 13, 32).bfloat16()
    (y, grads, saved), (want_y, want_grads, want_saved) = _ours_and_stock(
        block, x, grad_y, autocast=True)
    assert y.dtype == want_y.dtype == torch.bfloat16
    assert saved == want_saved
    assert torch.equal(y, want_y)                         # the same ops on the same views
    assert all(torch.equal(g, want) for g, want in zip(grads, want_grads))


def test_precision_medium_is_one_bf16_product_per_matmul(monkeypatch):
    """precision="medium" (explicit, or torch's setting with None): the one-product path
    in bf16 on float32 tensors, outside autocast too: the output and every gradient in
    float32, within bf16's error of float64 (not float32's)."""
    calls = _recorded_precisions(monkeypatch)
    block = _randomize(VisionAttentionBlock(32, 4, precision="medium"))
    x = torch.randn(3, 13, 32)
    grad_y = torch.randn(3, 13, 32)
    y = _check_against_truth(block, x, grad_y, {torch.float32: 2e-2})
    assert y.dtype == torch.float32
    assert calls == [["torch.bfloat16", "torch.bfloat16"]]
    truth = block_step_float64(block, x, grad_y)[0]
    assert relative_errors([y], [truth])[0] > 1e-3


@pytest.mark.parametrize("precision", ["low", "fast", "High", 3])
def test_unknown_precision_is_refused(precision):
    with pytest.raises(ValueError, match=r"precision must be one of "
                                         r"\(None, 'highest', 'high', 'medium'\)"):
        VisionAttentionBlock(32, 4, precision=precision)
    block = VisionAttentionBlock(32, 4)
    params = [p.detach() for p in block.parameters()]
    with pytest.raises(ValueError, match="precision must be one of"):
        vision_attention(torch.randn(1, 3, 32), *params, 4, 1e-5, precision=precision)


def _recorded_precisions(monkeypatch):
    """[(forward's precision, backward's precision)] of each fused call, recorded at the
    compiled graphs' entry points; the one-product path's is its half dtype
    ("torch.bfloat16"), that of the saved QKV projection in the backward."""
    from vitattn_bwd import graph, module
    calls = []
    forward, backward = module.attention_block_forward, graph.compiled_backward

    def precision_of(products):
        half_dtype = products.half_dtype
        return ({"bf16x3": "high", "fp16x3": "highest"}[products.value]
                if half_dtype is None else str(half_dtype))

    def recording_forward(*args):
        calls.append([precision_of(args[9])])
        return forward(*args)

    def recording_backward(inputs, **options):
        qkv_dtype = inputs["qkv"].dtype
        calls[-1].append(precision_of(options["products"]) if qkv_dtype == torch.float32
                         else str(qkv_dtype))
        return backward(inputs, **options)
    monkeypatch.setattr(module, "attention_block_forward", recording_forward)
    monkeypatch.setattr(graph, "compiled_backward", recording_backward)
    return calls


@pytest.mark.parametrize("torch_precision,runs", [("highest", "highest"), ("high", "high"),
                                                  ("medium", "torch.bfloat16")])
def test_default_precision_follows_torch_at_each_call(monkeypatch, torch_precision, runs):
    """precision None reads torch.get_float32_matmul_precision() when the block runs
    (not when it is made): "medium" runs the one-product path in bf16; an explicit
    precision ignores torch's setting."""
    calls = _recorded_precisions(monkeypatch)
    default, explicit = (_randomize(VisionAttentionBlock(32, 4, precision=p))
                         for p in (None, "highest"))
    x = torch.randn(2, 5, 32, requires_grad=True)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(torch_precision)
    try:
        default(x).sum().backward()
        explicit(x).sum().backward()
    finally:
        torch.set_float32_matmul_precision(before)
    assert calls == [[runs, runs], ["highest", "highest"]]


@pytest.mark.parametrize("cuda_precision,runs", [("tf32", "high"), ("ieee", "highest")])
def test_default_precision_follows_torchs_per_backend_setting(monkeypatch, cuda_precision,
                                                              runs):
    """Set through the per-backend API (torch.backends.cuda.matmul.fp32_precision), where
    torch.get_float32_matmul_precision() raises once the legacy and new settings are
    mixed, precision None still follows torch: "tf32" runs "high", "ieee" "highest"."""
    calls = _recorded_precisions(monkeypatch)
    block = _randomize(VisionAttentionBlock(32, 4))
    x = torch.randn(2, 5, 32, requires_grad=True)
    matmul = torch.backends.cuda.matmul
    before, before_legacy = matmul.fp32_precision, torch.get_float32_matmul_precision()
    matmul.fp32_precision = cuda_precision
    try:
        block(x).sum().backward()
    finally:
        matmul.fp32_precision = before
        torch.set_float32_matmul_precision(before_legacy)
    assert calls == [[runs, runs]]


def test_precisions_compute_the_same_plain_math_on_the_cpu():
    """On the CPU the fused path's products are plain float32 matmuls at every
    precision: the same output and gradients, bit for bit."""
    torch.manual_seed(3)
    results = []
    for precision in ("highest", "high"):
        block = _randomize(VisionAttentionBlock(32, 4, precision=precision), seed=1)
        x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2),
                        requires_grad=True)
        y = block(x)
        results.append([y, *torch.autograd.grad(y.square().sum(), [x, *block.parameters()])])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_block_with_precision_high_computes_in_float32(dtype):
    block = _randomize(VisionAttentionBlock(32, 4, precision="high")).to(dtype)
    x = torch.randn(3, 13, 32).to(dtype)
    grad_y = torch.randn(3, 13, 32).to(dtype)
    y = _check_against_truth(block, x, grad_y, ROUNDED_ONCE)
    assert y.dtype == dtype
    # .grad lands in the parameter's dtype, ready for the optimizer
    block(x).backward(grad_y)
    assert all(p.grad.dtype == dtype for p in block.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_block_is_native_by_default(dtype):
    """A block whose input and parameters are all bf16 (or all fp16) computes, with
    precision None, what the stock block computes in that dtype: the same output and
    gradients bit for bit, the same saved activations, no float32 copies."""
    block = _randomize(VisionAttentionBlock(32, 4)).to(dtype)
    x = torch.randn(3, 13, 32).to(dtype)
    grad_y = torch.randn(3, 13, 32).to(dtype)
    (y, grads, saved), (want_y, want_grads, want_saved) = _ours_and_stock(
        block, x, grad_y, autocast=False)
    assert y.dtype == dtype and saved == want_saved
    assert torch.equal(y, want_y)
    assert all(g.dtype == dtype and torch.equal(g, want) for g, want in zip(grads, want_grads))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_precision_medium_runs_a_half_precision_block_natively(monkeypatch, dtype):
    """A block whose input and parameters are all bf16 (or all fp16) runs, at precision
    "medium", the fused one-product path in that dtype, as the stock block computes
    there (one product per matmul in that dtype, float32 statistics): the
    output and every gradient in that dtype, no further from float64 than the stock
    block's, no float32 copy of an activation saved (the LayerNorm statistics and the
    log-sum-exp are float32, as stock's are), no more bytes saved than stock saves."""
    calls = _recorded_precisions(monkeypatch)
    block = _randomize(VisionAttentionBlock(32, 4, precision="medium")).to(dtype)
    x = torch.randn(3, 13, 32).to(dtype)
    grad_y = torch.randn(3, 13, 32).to(dtype)
    (y, grads, saved), (want_y, want_grads, want_saved) = _ours_and_stock(
        block, x, grad_y, autocast=False)
    assert calls == [[str(dtype), str(dtype)]]
    assert saved <= want_saved, (saved, want_saved)
    truth = block_step_float64(block, x, grad_y)
    ours_errors = relative_errors([y, *grads], truth)
    stock_errors = relative_errors([want_y, *want_grads], truth)
    names = ["y", "x"] + [n for n, _ in block.named_parameters()]
    for name, g, ours, stock in zip(names, [y, *grads], ours_errors, stock_errors):
        assert g.dtype == dtype, (name, g.dtype)
        assert ours <= 1.1 * stock + ROUNDED_ONCE[dtype] / 4, (name, ours, stock)
    block.zero_grad()
    x = x.detach().requires_grad_()
    _, saved_dtypes = _saved_dtypes(lambda: block(x))
    assert set(saved_dtypes) == {dtype, torch.float32}
    assert saved_dtypes.count(torch.float32) == 3    # the statistics and log-sum-exp


def test_float32_input_into_a_bfloat16_block():
    block = _randomize(VisionAttentionBlock(32, 4)).bfloat16()
    x = torch.randn(2, 9, 32)
    y = _check_against_truth(block, x, torch.randn(2, 9, 32), ROUNDED_ONCE)
    assert y.dtype == torch.float32


def test_function_refuses_other_dtypes_in_the_forward():
    block = _randomize(VisionAttentionBlock(16, 2)).bfloat16()
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(TypeError, match="vision_attention casts"):
        VisionAttentionFunction.apply(x, *block.parameters(), 2, 1e-5)
    params = [p.detach().float() for p in block.parameters()]
    params[2] = params[2].double()
    with pytest.raises(TypeError, match="qkv_weight has dtype torch.float64"):
        VisionAttentionFunction.apply(x.float(), *params, 2, 1e-5)
    with pytest.raises(ValueError, match="qkv_weight must have shape"):
        vision_attention(x, *[p.detach() for p in block.parameters()][:2],
                         torch.zeros(48, 8), *[p.detach() for p in block.parameters()][3:],
                         2, 1e-5)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        vision_attention(torch.ones(2, 5, 16, dtype=torch.int64),
                         *[p.detach() for p in block.parameters()], 2, 1e-5)


def test_cuda_forward_graph_compiled_for_the_cpu_is_float32_grade():
    """The forward graph VisionAttentionBlock compiles on CUDA (bf16x3 projections, the
    activations split by the kernels Inductor fuses them into), compiled here for the
    CPU, where each split GEMM runs as a float32 matmul of the bf16 parts (exact
    products, as on the tensor cores): every output within ~4e-6 of float64 (rounded
    splits; truncated ones measured ~1.1e-5), where one bf16 product per projection, or
    a split whose lo part Inductor folded away, would be ~1e-3 off."""
    from vitattn_bwd import forward_graph, graph
    block = _randomize(VisionAttentionBlock(64, 4))
    params = dict(ln_weight=block.norm.weight, ln_bias=block.norm.bias,
                  qkv_weight=block.qkv.weight, qkv_bias=block.qkv.bias,
                  out_weight=block.out_proj.weight, out_bias=block.out_proj.bias)
    params = {name: p.detach() for name, p in params.items()}
    x = torch.randn(2, 17, 64)

    def split_forward(**tensors):
        return forward_graph.block_forward(**tensors, num_heads=4, eps=1e-5,
                                           products=Products.BF16X3)
    compiled = graph.compile_graph(split_forward, "cpu", "test-", None, (), cuda_graph=False)
    got = compiled(x=x, **params)
    want = forward_graph.block_forward(x=x.double(), **{n: p.double() for n, p in params.items()},
                                       num_heads=4, eps=1e-5, products=Products.PLAIN)
    names = ("y", "x_mean", "x_var", "qkv", "lse", "attn_output")
    errors = dict(zip(names, relative_errors(list(got), list(want))))
    assert all(err < 8e-6 for err in errors.values()), errors
    # the projections are not plain float32 matmuls: their outputs carry bf16x3's error
    assert errors["qkv"] > 1e-7, errors


def test_compiled_graph_is_one_graph_for_parameters_and_plain_tensors():
    """A module's weights reach our compiled graphs as nn.Parameters requiring grad from
    an eager call and as plain tensors from torch.compile(model)'s saved tensors: both
    run one dynamo graph (a second would be a compile inside a reduce-overhead capture,
    where GraphedCall runs the graph directly), with the same values."""
    from vitattn_bwd import graph
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(2, 5, 8)

    def scaled_product(x, weight):
        return (x @ weight * 0.5,)
    compiled = graph.compile_graph(scaled_product, "cpu", "test-plain-", (2, 15), ("x",),
                                   cuda_graph=False)
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    from_parameter = compiled(x=x.requires_grad_(), weight=weight)
    from_plain = compiled(x=x.detach(), weight=weight.detach().clone())
    assert counters["unique_graphs"] - before == 1
    assert not from_parameter[0].requires_grad
    assert torch.equal(from_parameter[0], from_plain[0])
    torch.testing.assert_close(from_plain[0], x.detach() @ weight.detach() * 0.5)


@pytest.mark.parametrize("head_dim,split_attention", [(16, True), (12, False)])
def test_split_forward_hands_the_kernel_split_operands_only_where_it_applies(
        head_dim, split_attention):
    """With three products the forward gives its attention operator q, k, v as bf16
    halves (attention_fwd_split) only for head dims the Triton kernel takes; other head
    dims keep float32 q, k, v (attention_fwd), not the halves' 1e-5 rounding."""
    from vitattn_bwd import attention_fwd, forward_graph
    from vitattn_bwd.layout import split_heads
    torch.manual_seed(1)
    E, H = 4 * head_dim, 4
    block = VisionAttentionBlock(E, H)
    params = [p.detach() for p in block.parameters()]
    x = torch.randn(2, 9, E)
    _, _, _, qkv, lse, attn_output = forward_graph.block_forward(
        x, *params, num_heads=H, eps=1e-5, products=Products.BF16X3)
    q, k, v = (split_heads(t, H) for t in qkv.chunk(3, dim=-1))
    float32_output, _ = attention_fwd.attention_fwd(q, k, v, head_dim ** -0.5)
    assert torch.equal(attn_output, float32_output) != split_attention
    torch.testing.assert_close(attn_output, float32_output, rtol=1e-4, atol=1e-5)
