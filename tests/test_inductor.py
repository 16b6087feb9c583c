"""Registration of the attention-core templates and the cache-key tag (CPU side; the
templates themselves compile only on CUDA, see test_gpu.py)."""
import inspect

import pytest
import torch


inductor = pytest.importorskip("vitattn_bwd.inductor")     # needs triton


def test_lowerings_are_registered_for_both_operators():
    from torch._inductor.lowering import lowerings
    assert lowerings[torch.ops.vitattn_bwd.softmax_bwd_rows.default] is inductor._lower_rows
    assert lowerings[torch.ops.vitattn_bwd.softmax_bwd_cols.default] is inductor._lower_cols


def test_templates_carry_the_tested_device_code_verbatim():
    """Every non-kernel @triton.jit function of kernels/softmax_bwd.py is pasted into the
    templates, so what runs under the interpreter is what Inductor compiles."""
    from vitattn_bwd.kernels import softmax_bwd as kernels_module
    body = inductor._device_source()
    names = [jit.fn.__name__ for jit in inductor.device_functions()]
    assert "softmax_bwd_rows_tile" in names and "store_grad_kv_halves" in names
    assert not [name for name in names if name.endswith("_kernel")]
    for name in names:
        assert inspect.getsource(getattr(kernels_module, name).fn) in body


def test_compile_options_carry_the_cache_tag_and_change_nothing_global():
    before = (torch._inductor.config.epilogue_fusion, torch._inductor.config.max_autotune)
    options = inductor.compile_options("tag-1", max_autotune=True)
    assert options["post_grad_custom_post_pass"].uuid() == "tag-1"
    assert options["max_autotune"] and not options["epilogue_fusion"]
    assert "triton.cudagraphs" not in options
    assert "cpp_wrapper" not in options
    assert inductor.compile_options("tag-1", max_autotune=False, cpp_wrapper=True)["cpp_wrapper"]
    assert (torch._inductor.config.epilogue_fusion,
            torch._inductor.config.max_autotune) == before


def test_graph_launched_from_the_cpp_wrapper_gives_the_python_wrappers_bits(monkeypatch):
    """CUDA graphs launch their kernels from Inductor's C++ wrapper
    (graph.CPP_WRAPPER_DEVICES); the same wrapper on the CPU's graph, against the Python
    one: the same kernels, so the same bits, at a static and a dynamic batch."""
    from tests.helpers import make_case
    from vitattn_bwd import contract, graph
    assert graph.CPP_WRAPPER_DEVICES == ("cuda",)
    options_given = []
    compile_options = inductor.compile_options

    def recorded(*args, **kwargs):
        options_given.append(compile_options(*args, **kwargs))
        return options_given[-1]
    monkeypatch.setattr(inductor, "compile_options", recorded)
    outputs = {}
    for devices in ((), ("cpu",)):
        monkeypatch.setattr(graph, "CPP_WRAPPER_DEVICES", devices)
        graph._compile.cache_clear()
        outputs[devices] = [contract.run(*make_case(B, 9, 2, 8).values()) for B in (1, 3)]
    graph._compile.cache_clear()
    # each batch bucket's graph compiled once with each wrapper
    assert [options.get("cpp_wrapper", False) for options in options_given] == [
        False, False, True, True]
    for python_wrapper, cpp_wrapper in zip(*outputs.values()):
        for a, b in zip(python_wrapper, cpp_wrapper):
            assert torch.equal(a, b)


def test_compiled_cpu_graph_goes_through_the_lowering_fallback():
    """On the CPU the lowering hands the operator back to its eager implementation;
    the compiled result equals the eager one."""
    from vitattn_bwd import softmax_bwd
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(2, 2, 9, 9, generator=g), -1)
    grad_attn = torch.randn(2, 9, 16, generator=g)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g) for _ in range(3))

    def rows(P, grad_attn, k, v):
        return softmax_bwd.softmax_bwd_rows(grad_attn, q, k, v, None, 0.3, "bf16x3", P)

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


def test_split_cache_tells_apart_views_of_one_buffer_at_different_offsets():
    """The module's q, k, v at batch 1 and one token: three views of one qkv buffer with
    the same name, size and strides (size-1 dimensions make them contiguous, so the
    lowering does not copy them). Only the offset tells them apart; a key without it
    handed k and v the halves of q (wrong gradients on the H200, session 7)."""
    from torch._inductor import ir
    cpu = torch.device("cpu")
    qkv = ir.InputBuffer(name="qkv", layout=ir.FixedLayout(cpu, torch.float32, [1, 1, 96],
                                                            [96, 96, 1]))
    q, k, v = (ir.ReinterpretView(data=qkv, layout=ir.FixedLayout(
        cpu, torch.float32, [1, 1, 1, 32], [96, 32, 96, 1], offset=offset))
        for offset in (0, 32, 64))
    assert q.get_name() == k.get_name() == v.get_name()
    assert len({inductor._split_key(view) for view in (q, k, v)}) == 3
    assert inductor._split_key(q) == inductor._split_key(ir.ReinterpretView(
        data=qkv, layout=ir.FixedLayout(cpu, torch.float32, [1, 1, 1, 32], [96, 32, 96, 1])))


class _Node:
    """An IR input node as _fits_autotuning reads it: device, element count, dtype."""

    def __init__(self, numel, device="cuda"):
        self.numel, self.device = numel, torch.device(device, 0)

    def get_device(self):
        return self.device

    def get_numel(self):
        return self.numel

    def get_dtype(self):
        return torch.float32


class _Graph:
    """V.graph as _fits_autotuning reads it: size hints of concrete numbers."""

    class sizevars:
        @staticmethod
        def optimization_hint(expr, fallback=None):
            return int(expr)


def test_lowerings_take_their_first_choice_untimed_past_an_eighth_of_device_memory(
        monkeypatch):
    """Inputs of more than AUTOTUNE_MAX_INPUT_FRACTION of the device's memory (their
    copies for timing would not fit beside the caller's tensors): _select hands the
    autotuner the first choice only; at that fraction or below, or off CUDA, every
    choice."""
    from types import SimpleNamespace

    from torch._inductor.virtualized import V
    device_bytes = 32_000                             # an eighth: 4,000 bytes, 1,000 floats
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=device_bytes))
    offered = []
    monkeypatch.setattr(inductor, "autotune_select_algorithm",
                        lambda name, choices, *args, **kwargs: offered.append(choices))
    template = SimpleNamespace(name="template")
    with V.set_graph_handler(_Graph()):
        assert inductor._fits_autotuning([_Node(600), _Node(400)])
        assert not inductor._fits_autotuning([_Node(600), _Node(401)])
        assert inductor._fits_autotuning([_Node(10 ** 6, device="cpu")])
        inductor._select(template, ["gluon", "triton"], [_Node(600), _Node(400)], None)
        inductor._select(template, ["gluon", "triton"], [_Node(600), _Node(401)], None)
    assert offered == [["gluon", "triton"], ["gluon"]]


def test_holds_compiled_graphs_until_dynamo_resets():
    """The private dynamo API GraphedCall relies on to compile our graphs again after
    torch._dynamo.reset() (cuda_graphs.py): False before the first compile and after a
    reset, True in between."""
    def double(x):
        return 2 * x
    compiled = torch.compile(double, backend="eager", fullgraph=True)
    assert not inductor.holds_compiled_graphs(double.__code__)
    compiled(torch.ones(3))
    assert inductor.holds_compiled_graphs(double.__code__)
    torch._dynamo.reset()
    assert not inductor.holds_compiled_graphs(double.__code__)
