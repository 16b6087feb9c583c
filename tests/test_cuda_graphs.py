"""cuda_graphs on the CPU: static_buffers (what a CUDA graph is captured on must look to
dynamo like the caller's tensors, and must stay writable by later calls), and
GraphedCall's bookkeeping with stand-ins for the capture. (The graphs themselves:
tests/test_gpu_cuda_graphs.py.)"""
import torch

from vitattn_bwd.cuda_graphs import static_buffers
from vitattn_bwd.layout import split_heads


def _module_style_inputs():
    """q, k, v as the module saves them: [B,H,S,D] views of one [B,S,3E] tensor, and a
    weight that requires grad."""
    qkv = torch.randn(2, 5, 3 * 8)
    q, k, v = (split_heads(t, 2) for t in qkv.chunk(3, dim=-1))
    return dict(q=q, k=k, v=v, weight=torch.randn(8, 8, requires_grad=True))


def test_static_buffers_match_shape_strides_dtype_and_requires_grad():
    inputs = _module_style_inputs()
    static = static_buffers(inputs)
    for name, t in inputs.items():
        s = static[name]
        assert (s.shape, s.stride(), s.dtype, s.requires_grad) == \
            (t.shape, t.stride(), t.dtype, t.requires_grad), name
        assert torch.equal(s.detach(), t.detach()), name
        assert s.data_ptr() != t.data_ptr(), name


def test_static_buffers_of_a_modules_weights_compile_no_second_graph():
    """A module's weights (nn.Parameter) get Parameter buffers: a compiled function
    called on the caller's tensors, then on the static buffers, compiles once."""
    compiled = torch.compile(lambda x, weight: (x @ weight).relu(), backend="eager")
    inputs = dict(x=torch.randn(4, 8), weight=torch.nn.Parameter(torch.randn(8, 8)))
    static = static_buffers(inputs)
    assert isinstance(static["weight"], torch.nn.Parameter)
    assert not isinstance(static["x"], torch.nn.Parameter)
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    compiled(**inputs)
    compiled(**static)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_static_buffers_made_in_inference_mode_take_later_copies():
    with torch.inference_mode():
        inputs = _module_style_inputs()
        static = static_buffers(inputs)
    assert not any(s.is_inference() for s in static.values())
    fresh = _module_style_inputs()
    with torch.no_grad():
        torch._foreach_copy_(list(static.values()), list(fresh.values()))
    assert all(torch.equal(static[n].detach(), fresh[n].detach()) for n in fresh)


def test_a_call_inside_the_callers_capture_runs_fn_directly(monkeypatch):
    """Inside a CUDA-graph capture of the caller's (torch.compile's CUDA graphs, a
    torch.cuda.graph block), GraphedCall neither captures nor replays a graph of its
    own: it calls fn, whose kernels go into the caller's graph. (Checked first, before
    any CUDA call, so a stand-in capture state shows it on the CPU.)"""
    from vitattn_bwd.cuda_graphs import GraphedCall
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    calls = []

    def fn(**inputs):
        calls.append(sorted(inputs))
        return [inputs["a"] * 2, inputs["b"].sum()]
    graphed = GraphedCall(fn)
    a, b = torch.ones(3), torch.arange(4.0)
    for _ in range(2):
        out = graphed(a=a, b=b)
        assert isinstance(out, tuple)
        assert torch.equal(out[0], a * 2) and out[1].item() == 6.0
    assert calls == [["a", "b"], ["a", "b"]]
    assert graphed._graphs == {}


class _FakeCaptured:
    """Stands in for cuda_graphs._Captured on the CPU: 'captures' by running fn once, as
    the real one does before its capture, and 'replays' by running fn."""
    captures = []

    def __init__(self, fn, inputs):
        self.fn, self.done = fn, None
        fn(**inputs)
        _FakeCaptured.captures.append(sorted((n, tuple(t.shape)) for n, t in inputs.items()))

    def replay(self, inputs):
        return tuple(self.fn(**inputs))


def test_signatures_are_captured_again_after_dynamo_drops_fns_graphs(monkeypatch):
    """Once holds_compiled() turns False (torch._dynamo.reset()), each signature captured
    before is captured again at its next call (fn compiling outside any capture),
    those captured after are not, and a holds_compiled() False from the start (dynamo
    compiling nothing) captures nothing again."""
    from vitattn_bwd import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "_Captured", _FakeCaptured)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)   # CPU tensors' index
    monkeypatch.setattr(_FakeCaptured, "captures", [])
    compiled = [True]                  # what dynamo holds: fn's runs compile it

    def fn(x):
        compiled[0] = True
        return (x + 1,)
    graphed = cuda_graphs.GraphedCall(fn, lambda: compiled[0])
    small, large = torch.zeros(2), torch.zeros(3)
    for x in (small, large, small, large):
        assert torch.equal(graphed(x=x)[0], x + 1)
    assert len(_FakeCaptured.captures) == 2
    compiled[0] = False                # torch._dynamo.reset()
    for x in (small, small, large, large):
        assert torch.equal(graphed(x=x)[0], x + 1)
    assert _FakeCaptured.captures[2:] == [[("x", (2,))], [("x", (3,))]]

    monkeypatch.setattr(_FakeCaptured, "captures", [])
    never = cuda_graphs.GraphedCall(lambda x: (x * 2,), lambda: False)
    for x in (small, small, large, large):
        assert torch.equal(never(x=x)[0], x * 2)
    assert len(_FakeCaptured.captures) == 2


def test_a_signature_met_while_another_pool_takes_allocations_is_captured_later(
        monkeypatch):
    """While another pool takes the thread's allocations (Inductor's CUDA graph trees
    warming up), a new signature and a stale one (after dynamo dropped fn's graphs) run
    fn directly, leaving nothing of a capture in that pool; a captured, current one still
    replays; each is captured at its next call outside."""
    from vitattn_bwd import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "_Captured", _FakeCaptured)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)   # CPU tensors' index
    monkeypatch.setattr(_FakeCaptured, "captures", [])
    compiled, warming_up, calls = [True], [False], []

    def fn(x):
        compiled[0] = True
        calls.append(x.numel())
        return (x + 1,)
    graphed = cuda_graphs.GraphedCall(fn, lambda: compiled[0],
                                      pool_taken=lambda device_index: warming_up[0])
    small, large = torch.zeros(2), torch.zeros(3)
    assert torch.equal(graphed(x=small)[0], small + 1)        # captured outside
    warming_up[0] = True
    for x in (large, small):            # new: runs directly; captured: replays
        assert torch.equal(graphed(x=x)[0], x + 1)
    assert _FakeCaptured.captures == [[("x", (2,))]]
    compiled[0] = False                 # torch._dynamo.reset()
    calls.clear()
    assert torch.equal(graphed(x=small)[0], small + 1)        # stale: runs directly
    assert calls == [2] and len(_FakeCaptured.captures) == 1
    warming_up[0] = False
    for x in (large, small, large, small):
        assert torch.equal(graphed(x=x)[0], x + 1)
    assert _FakeCaptured.captures[1:] == [[("x", (3,))], [("x", (2,))]]
