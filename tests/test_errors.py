"""A device out-of-memory raised inside our calls, also wrapped by Inductor's compile,
reaches the caller as torch.OutOfMemoryError (vitattn_bwd/errors.py); other errors, and a
kernel's shared memory running out, stay as they are."""
import threading

import pytest
import torch
from torch._inductor.exc import InductorError, LoweringException

from vitattn_bwd import api, graph
from vitattn_bwd.errors import out_of_memory_as_such, out_of_memory_in

from .helpers import assert_within_bounds, make_case

DEVICE_OOM = "CUDA out of memory. Tried to allocate 51.60 GiB"


def _inductor_wrapped(inner):
    """What Inductor raises when a lowering hits `inner`: a LoweringException raised
    while handling it, inside an InductorError."""
    try:
        try:
            raise inner
        except Exception as error:
            raise LoweringException(error, "aten.mm", [], {}) from None
    except LoweringException as lowering:
        return InductorError(lowering, None)


def test_an_out_of_memory_inside_a_compile_is_found():
    cause = torch.OutOfMemoryError(DEVICE_OOM)
    assert out_of_memory_in(_inductor_wrapped(cause)) is cause
    copied = RuntimeError(f"LoweringException: OutOfMemoryError: {DEVICE_OOM}")
    assert out_of_memory_in(copied) is copied


def test_shared_memory_and_other_errors_are_not_out_of_memory():
    resources = RuntimeError("out of resource: shared memory, Required: 262144, "
                             "Hardware limit: 232448")
    assert out_of_memory_in(_inductor_wrapped(resources)) is None
    assert out_of_memory_in(ValueError("x must be [batch, tokens, embed_dim]")) is None


def test_the_wrapper_raises_out_of_memory_chained_to_the_original():
    wrapped = _inductor_wrapped(torch.OutOfMemoryError(DEVICE_OOM))

    @out_of_memory_as_such
    def compile_and_run():
        raise wrapped

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as raised:
        compile_and_run()
    assert raised.value.__cause__ is wrapped

    @out_of_memory_as_such
    def bad_argument():
        raise ValueError("num_heads must divide embed_dim")

    with pytest.raises(ValueError, match="num_heads"):
        bad_argument()


def test_the_contract_entry_point_raises_out_of_memory_and_then_runs(monkeypatch):
    """An out-of-memory in the compiled graph's compile reaches the caller of
    attention_block_backward as torch.OutOfMemoryError; the next call runs."""
    inputs = make_case(1, 9, 2, 8)
    compile_graph = graph._compile

    def out_of_memory(*args, **kwargs):
        def run(**tensors):
            raise _inductor_wrapped(torch.OutOfMemoryError(DEVICE_OOM))
        return run

    monkeypatch.setattr(graph, "_compile", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        api.attention_block_backward(**inputs, num_heads=2)
    monkeypatch.setattr(graph, "_compile", compile_graph)
    grads = api.attention_block_backward(**inputs, num_heads=2)
    assert_within_bounds(grads, inputs, num_heads=2, ln_grad="exact")



def test_the_compiled_forward_raises_out_of_memory():
    """VisionAttentionBlock's compiled forward is called through
    forward_graph._run_compiled (CUDA only: the CPU runs it uncompiled), which converts
    the same way."""
    from vitattn_bwd import forward_graph

    def out_of_memory(**tensors):
        raise _inductor_wrapped(torch.OutOfMemoryError(DEVICE_OOM))

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        forward_graph._run_compiled(out_of_memory, {})


class _GrowInBackward(torch.autograd.Function):
    """Identity whose backward first calls `run` on `too_big` (as the module's backward
    calls its compiled graph on autograd's thread)."""

    @staticmethod
    def forward(ctx, x, run, too_big, w):
        ctx.run, ctx.too_big, ctx.w = run, too_big, w
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.run(ctx.too_big, ctx.w)
        return grad, None, None, None


_DOUBLED_CALLS = []


@torch.library.custom_op("vitattn_bwd_tests::doubled", mutates_args=())
def _doubled(x: torch.Tensor, how: str) -> torch.Tensor:
    """2x, counted: a custom op with a str argument, as the Gluon operators' `products`
    (torch 2.11's C++ wrapper calls such an op back in Python)."""
    _DOUBLED_CALLS.append(how)
    return x * 2


@_doubled.register_fake
def _(x, how):
    return torch.empty_like(x)


def test_a_failed_allocation_in_the_cpp_wrapper_is_out_of_memory():
    """Inductor's C++ wrapper (which launches the CUDA graphs' kernels) reports a buffer
    it cannot allocate as a RuntimeError naming the failed call, without the allocator's
    message: here a real one, from a CPU graph whose intermediate (400,000 x 2^20
    float32, 1.6 TB) cannot be allocated after a custom op with a str argument ran,
    reaches the caller as torch.OutOfMemoryError, from the main thread and from a
    backward run on another thread alike."""
    def grow(x, w):
        x = _doubled(x, "twice")
        return (x @ w).relu().sum(0)                          # [B, 2^20] in between

    run = out_of_memory_as_such(torch.compile(grow, dynamic=False,
                                              options={"cpp_wrapper": True}))
    w = torch.randn(8, 2 ** 20)
    torch.testing.assert_close(run(torch.ones(2, 8), w), (2 * w.sum(0)).relu() * 2)
    assert _DOUBLED_CALLS == ["twice"]                        # ran inside the graph
    x = torch.randn(400_000, 8)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(torch.OutOfMemoryError, match="could not allocate") as raised:
        run(x, w)
    assert isinstance(raised.value.__cause__, RuntimeError)

    raised_in_thread = []

    def step():
        leaf = torch.ones(2, 8, requires_grad=True)
        try:
            _GrowInBackward.apply(leaf, run, x, w).sum().backward()
        except Exception as error:
            raised_in_thread.append(error)
    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert [type(e) for e in raised_in_thread] == [torch.OutOfMemoryError]
