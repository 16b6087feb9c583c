"""The reference math itself: exact mode is autograd's gradient, contract mode is the
contract's formula."""
import pytest
import torch
from torch import nn

from vitattn_bwd import reference
from vitattn_bwd.forward_graph import attention_block_forward
from vitattn_bwd.precision import Products
from vitattn_bwd.workloads import OUTPUT_NAMES

from .helpers import make_case, reference_grads


def _block_params(E, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, dtype=dtype, generator=g) * s
            for shape, s in (((E,), 1.0), ((E,), 0.1), ((3 * E, E), E ** -0.5),
                             ((3 * E,), 0.1), ((E, E), E ** -0.5), ((E,), 0.1))]


@pytest.mark.parametrize("B,S,E,H", [(2, 7, 16, 2), (1, 13, 32, 4), (3, 5, 24, 3)])
def test_exact_mode_equals_autograd_of_plain_block(B, S, E, H):
    params = [p.requires_grad_() for p in _block_params(E)]
    x = torch.randn(B, S, E, dtype=torch.float64, requires_grad=True)
    y = reference.block_forward(x, *params, num_heads=H, eps=1e-5)
    grad_y = torch.randn_like(y)
    autograd = torch.autograd.grad(y, [x, *params], grad_y)

    _, saved, scale = attention_block_forward(x.detach(), *[p.detach() for p in params],
                                              num_heads=H, eps=1e-5, products=Products.PLAIN)
    (x_, x_mean, x_var, ln_weight, ln_bias, qkv_weight, qkv, lse, attn, out_weight) = saved
    q, k, v = (reference.split_heads(t, H) for t in qkv.chunk(3, dim=-1))
    x_norm = (x_ - x_mean) * torch.rsqrt(x_var + 1e-5) * ln_weight + ln_bias
    P = torch.exp((q @ k.transpose(-1, -2)) * scale - lse.unsqueeze(-1))  # what the backward recomputes
    grads = dict(zip(OUTPUT_NAMES, reference.attention_block_backward(
        grad_y, x_, x_mean, x_var, x_norm, ln_weight, qkv_weight, q, k, v, P, attn,
        out_weight, scale, 1e-5, num_heads=H, ln_grad="exact")))
    expected = dict(zip(("grad_x", "grad_ln_weight", "grad_ln_bias", "grad_qkv_weight",
                         "grad_qkv_bias", "grad_out_weight", "grad_out_bias"), autograd))
    for name, want in expected.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-10, atol=1e-12, msg=name)


def test_contract_mode_follows_the_contract_formula():
    """grad_x = grad_output + (gh - mean(gh)) / std - xhat * mean(gh * xhat), written out
    independently; the other six outputs equal exact mode's."""
    g = torch.Generator().manual_seed(2)
    B, S, E = 2, 5, 8
    grad_output, grad_x_norm, x = (torch.randn(B, S, E, dtype=torch.float64, generator=g)
                                   for _ in range(3))
    x_mean = torch.randn(B, S, 1, dtype=torch.float64, generator=g)
    x_var = torch.rand(B, S, 1, dtype=torch.float64, generator=g) + 0.1
    ln_weight = torch.randn(E, dtype=torch.float64, generator=g)
    std = (x_var + 1e-5).sqrt()
    xhat = (x - x_mean) / std
    gh = grad_x_norm * ln_weight
    want = grad_output + (gh - gh.mean(-1, keepdim=True)) / std \
        - xhat * (gh * xhat).mean(-1, keepdim=True)
    got, _, _ = reference.layer_norm_backward(grad_output, grad_x_norm, x, x_mean, x_var,
                                              ln_weight, 1e-5, "contract")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    exact, _, _ = reference.layer_norm_backward(grad_output, grad_x_norm, x, x_mean, x_var,
                                                ln_weight, 1e-5, "exact")
    assert (exact - got).abs().max() > 1e-3          # the two modes really differ


def test_unknown_ln_grad_mode_is_rejected():
    t = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="ln_grad"):
        reference.layer_norm_backward(t, t, t, t[..., :1], t[..., :1] + 1, torch.ones(2),
                                      1e-5, "approx")


class _ReorderedBlock(nn.Module):
    """A block with VisionAttentionBlock's parameter names, registered in another order
    (parameters() yields out_proj first)."""

    def __init__(self, E, H, params):
        super().__init__()
        self.num_heads, self.eps = H, 1e-5
        self.out_proj = nn.Linear(E, E, dtype=torch.float64)
        self.qkv = nn.Linear(E, 3 * E, dtype=torch.float64)
        self.norm = nn.LayerNorm(E, dtype=torch.float64)
        with torch.no_grad():
            for module, (weight, bias) in ((self.norm, params[0:2]), (self.qkv, params[2:4]),
                                           (self.out_proj, params[4:6])):
                module.weight.copy_(weight)
                module.bias.copy_(bias)


def test_reference_block_takes_parameters_by_name_not_by_order():
    E, H = 16, 2
    params = _block_params(E)
    block = _ReorderedBlock(E, H, params)
    assert next(block.parameters()).shape == (E, E)            # out_proj.weight first
    x = torch.randn(2, 5, E, dtype=torch.float64)
    want = reference.block_forward(x, *params, num_heads=H, eps=1e-5)
    torch.testing.assert_close(reference.ReferenceBlock(block)(x), want, rtol=0, atol=0)


def test_production_modules_do_not_import_the_reference():
    import ast
    from pathlib import Path
    package = Path(reference.__file__).parent
    importers = []
    for path in package.rglob("*.py"):
        if path.name == "reference.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] + [a.name for a in node.names]
                     if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n.split(".")[-1] == "reference" for n in names):
                importers.append(path.relative_to(package).as_posix())
    assert importers == []


def test_reference_over_chunks_of_the_batch_equals_the_whole_batch():
    """tests/helpers.reference_grads with `chunk` (the GPU big-batch test's float64
    reference, which does not fit an 80 GB card whole): grad_x concatenated and the
    weight gradients summed over chunks equal the whole batch's, to float64 rounding."""
    inputs = make_case(5, 7, 2, 8)
    whole = reference_grads(inputs, 2, "contract")
    chunked = reference_grads(inputs, 2, "contract", chunk=2)
    for name, got, want in zip(OUTPUT_NAMES, chunked, whole):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13, msg=name)
