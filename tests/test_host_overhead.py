"""Host work of OUR part of a call (issue 12 item 2), counted, not timed (issue 64: a
wall-clock bound flakes on a shared machine): validation.check_backward_inputs plus
graph.compiled_backward's own Python (batch bucket, CUDA-graph decision, the
compile-cache lookup) and the BlockGrads wrapping, with graph._compile replaced by a
stub that returns precomputed gradients: dynamo's guards, AOTAutograd's runtime wrapper
and Inductor's generated wrapper are not ours and are not counted here.

Counted per call, after a first call that makes the stub: Python function calls and
calls of C functions (sys.setprofile's "call" and "c_call" events, wherever they run),
and the tensor operations dispatched (a TorchDispatchMode). On torch 2.13 our part makes
43-45 Python calls, 53-54 C calls and 13 tensor operations, one detach per input (no
pass over the data); a config-patch context manager entered on every call (what used to
be there) makes ~120 Python calls, and check_finite=True's extra pass over every input
~90 tensor operations that read the data: the planted tests show both exceed the bounds.
Wall-clock host time per call is the benchmark scripts' business (scripts/bench_towers.py
--suite host).
"""
import functools
import sys
from collections import Counter

import pytest
import torch

import vitattn_bwd
from tests.helpers import dispatched_ops
from vitattn_bwd import graph
from vitattn_bwd.workloads import make_inputs

# At most this many Python calls / C calls in our part of a call: ~1.7x today's counts
# (room for a torch version's extra frame in is_compiling or a helper of ours), below
# the planted config patch's ~120 Python calls.
PYTHON_CALL_BOUND = 80
C_CALL_BOUND = 100
# The tensor operations our part may dispatch: aliases of an input (a detached view, or
# a copy only where an input has other strides, which these inputs do not), none that
# reads the data; at most one per input.
ALIAS_OPS = {"aten.detach.default", "aten.alias.default", "aten.view.default"}
INPUTS = 13


@pytest.fixture
def stubbed_graph(monkeypatch):
    """graph._compile replaced by a functools.cache'd factory of stubs returning seven
    precomputed tensors: compiled_backward runs its own Python in full, nothing else."""
    grads = tuple(torch.zeros(1) for _ in range(7))
    made = []

    @functools.cache
    def fake_compile(*key):
        made.append(key)

        def stub(**inputs):
            assert len(inputs) == INPUTS
            return grads
        return stub

    monkeypatch.setattr(graph, "_compile", fake_compile)
    return made


def _our_part(batch, check_finite=False):
    inputs = make_inputs(batch, seq_len=4, embed_dim=8, num_heads=2)
    scale, eps = inputs.pop("scale"), inputs.pop("norm_eps")

    def call():
        return vitattn_bwd.attention_block_backward(**inputs, scale=scale, norm_eps=eps,
                                                    num_heads=2, ln_grad="exact",
                                                    check_finite=check_finite)
    return call


def _counted(call):
    """(Python calls, C calls, tensor operations' names) of one call of `call`, after a
    first one (which makes the stub and fills the caches)."""
    call()
    events = Counter()

    def profile(frame, event, arg):
        events[event] += 1
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    with dispatched_ops() as ops:
        call()
    # the two events of the profiled call itself and of sys.setprofile's return
    return events["call"] - 1, events["c_call"] - 1, ops.names


@pytest.mark.parametrize("batch", [1, 3, 20])
def test_our_host_work_per_call_is_bounded(stubbed_graph, batch):
    call = _our_part(batch)
    assert isinstance(call(), vitattn_bwd.BlockGrads) and len(stubbed_graph) == 1
    python_calls, c_calls, ops = _counted(call)
    print(f"batch {batch}: {python_calls} Python calls, {c_calls} C calls, "
          f"{len(ops)} tensor operations")
    assert 0 < python_calls <= PYTHON_CALL_BOUND, python_calls
    assert 0 < c_calls <= C_CALL_BOUND, c_calls
    assert set(ops) <= ALIAS_OPS and len(ops) <= INPUTS, Counter(ops)
    assert len(stubbed_graph) == 1            # every call after the first hit the cache


def test_planted_config_patch_exceeds_the_bound(stubbed_graph, monkeypatch):
    """A config-patch context manager entered on every call (what used to be there) is
    caught by the bound above."""
    import torch._inductor.config as inductor_config
    original = graph.compiled_backward

    def patched(inputs, **kwargs):
        with inductor_config.patch({"epilogue_fusion": False, "max_autotune": False,
                                    "triton.cudagraphs": False}), \
                torch._dynamo.config.patch(cache_size_limit=8):
            return original(inputs, **kwargs)

    from vitattn_bwd import api
    monkeypatch.setattr(api, "compiled_backward", patched)
    python_calls, _, _ = _counted(_our_part(3))
    print(f"planted: {python_calls} Python calls")
    assert python_calls > PYTHON_CALL_BOUND, python_calls


def test_planted_extra_pass_over_the_data_exceeds_the_bound(stubbed_graph):
    """One extra pass over every input (check_finite=True does exactly that) is caught:
    it dispatches operations that read the data."""
    _, _, ops = _counted(_our_part(3, check_finite=True))
    print(f"planted: {len(ops)} tensor operations")
    assert not set(ops) <= ALIAS_OPS and len(ops) > INPUTS, Counter(ops)
