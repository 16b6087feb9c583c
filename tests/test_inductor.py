"""Registration of the attention-core templates and the cache-key tag (CPU side; the
templates themselves compile only on CUDA, see test_gpu.py)."""
import hashlib
import inspect

import pytest
import torch

from vitattn_bwd import cache

inductor = pytest.importorskip("vitattn_bwd.inductor")     # needs triton


def test_lowerings_are_registered_for_both_operators():
    from torch._inductor.lowering import lowerings
    assert lowerings[torch.ops.vitattn_bwd.softmax_bwd_rows.default] is inductor._lower_rows
    assert lowerings[torch.ops.vitattn_bwd.softmax_bwd_cols.default] is inductor._lower_cols


def test_templates_carry_the_tested_device_code_verbatim():
    from vitattn_bwd.kernels import softmax_bwd
    body = inductor._device_source()
    for fn in (softmax_bwd.softmax_bwd_rows_tile, softmax_bwd.softmax_bwd_cols_tile,
               softmax_bwd.split_bf16, softmax_bwd.dot_bf16x3):
        assert inspect.getsource(fn.fn) in body


def test_cache_key_tag_hashes_the_template_and_graph_sources():
    digest = hashlib.sha256()
    for name in cache._TEMPLATE_SOURCES:
        digest.update((cache._PACKAGE / name).read_bytes())
    assert cache.cache_key_tag() == "vitattn_bwd-" + digest.hexdigest()[:16]
    assert "inductor.py" in cache._TEMPLATE_SOURCES
    assert "kernels/softmax_bwd.py" in cache._TEMPLATE_SOURCES


def test_compiled_cpu_graph_goes_through_the_lowering_fallback():
    """On the CPU the lowering hands the operator back to its eager implementation;
    the compiled result equals the eager one."""
    from vitattn_bwd import attention_core
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(2, 2, 9, 9, generator=g), -1)
    grad_attn = torch.randn(2, 9, 16, generator=g)
    k, v = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)

    def rows(P, grad_attn, k, v):
        return attention_core.softmax_bwd_rows(P, grad_attn, k, v, 0.3)

    calls = []
    original = inductor._lower_rows

    def spy(*args):
        calls.append(args)
        return original(*args)

    from torch._inductor.lowering import lowerings
    op = torch.ops.vitattn_bwd.softmax_bwd_rows.default
    lowerings[op] = spy
    try:
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):   # really lower it
            compiled = torch.compile(rows, fullgraph=True)(P, grad_attn, k, v)
    finally:
        lowerings[op] = original
    assert calls, "Inductor did not call our lowering"
    for got, want in zip(compiled, rows(P, grad_attn, k, v)):
        torch.testing.assert_close(got, want)
