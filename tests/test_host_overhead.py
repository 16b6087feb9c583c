"""Host time of OUR part of a call (issue 12 item 2): validation.check_backward_inputs plus
graph.compiled_backward's own Python (batch bucket, CUDA-graph decision, the compile-cache
lookup, mark_dynamic on the batched inputs) and the BlockGrads wrapping, with the compiled
function replaced by a stub that returns precomputed gradients: dynamo's guards,
AOTAutograd's runtime wrapper and Inductor's generated wrapper are not ours and are not
timed here.

Measured on this project's 2-core CPU machines (tiny sizes, median of 2,000 calls, each
timed in turn with the calibration): about
17 us of validation, 2 us of compiled_backward at batch 1 and 18 us at batch 3 (15 us of
that mark_dynamic on 10 tensors), ~40 us in all; 5-7x the time of detaching the 13
inputs. The bounds are generous (CI shares 2 cores) and relative to that calibration, so
that a slower machine does not fail them but a config-patch context manager or an extra
pass over the data entering the call does: the planted tests show both exceed them.
"""
import functools
import statistics
import time

import pytest
import torch

import vitattn_bwd
from vitattn_bwd import graph
from vitattn_bwd.workloads import make_inputs

CALLS = 2000
# our part at most this many times the calibration (13 detaches), and this many us.
# Timed in turn with the calibration, ours measures 3.3-3.4x, the planted config patch
# 10.6-10.8x and the planted extra pass 17.7-17.9x, on the machine's fast spells (23 us
# for ours) and its slow ones (41 us) alike. (Timed one after the other, ours read 3.5x
# alone and 6.6x once in a full CI run, the config patch 7.8-9.2x in full runs.) So the
# bound sits between them.
RATIO_BOUND = 6.0
ABSOLUTE_BOUND_US = 250.0


def _paired_us(fn, calibration, calls=CALLS, rounds=3):
    """(our us, calibration us) of the round whose ratio is smallest: each round times
    fn and the calibration call by call in turn, so that a slow spell of the shared
    machine falls on both (timed one after the other, ours once read 42 us against a
    6.4 us calibration in a full CI run, 24 us run alone); the median of `calls` each."""
    for _ in range(100):
        fn()
        calibration()
    best = (float("inf"), 1.0)
    for _ in range(rounds):
        ours, unit = [], []
        for _ in range(calls):
            start = time.perf_counter_ns()
            calibration()
            middle = time.perf_counter_ns()
            fn()
            unit.append(middle - start)
            ours.append(time.perf_counter_ns() - middle)
        pair = (statistics.median(ours) / 1000, statistics.median(unit) / 1000)
        if pair[0] / pair[1] < best[0] / best[1]:
            best = pair
    return best


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
            assert len(inputs) == 13
            return grads
        return stub

    monkeypatch.setattr(graph, "_compile", fake_compile)
    return made


def _inputs(batch):
    inputs = make_inputs(batch, seq_len=4, embed_dim=8, num_heads=2)
    return inputs, inputs.pop("scale"), inputs.pop("norm_eps")


def _our_part(batch, check_finite=False):
    inputs, scale, eps = _inputs(batch)

    def call():
        return vitattn_bwd.attention_block_backward(**inputs, scale=scale, norm_eps=eps,
                                                    num_heads=2, ln_grad="exact",
                                                    check_finite=check_finite)
    return call


def _timed(call):
    """(our part's us, calibration us): the calibration is a fixed amount of tensor-object
    work (detaching the 13 inputs), what the bounds are relative to."""
    tensors = list(_inputs(3)[0].values())
    return _paired_us(call, lambda: [t.detach() for t in tensors])


@pytest.mark.parametrize("batch", [1, 3, 20])
def test_our_host_time_per_call_is_bounded(stubbed_graph, batch):
    call = _our_part(batch)
    result = call()
    assert isinstance(result, vitattn_bwd.BlockGrads) and len(stubbed_graph) == 1
    ours, unit = _timed(call)
    print(f"batch {batch}: our part {ours:.1f} us, calibration {unit:.1f} us "
          f"(ratio {ours / unit:.1f})")
    assert ours < ABSOLUTE_BOUND_US, (ours, unit)
    assert ours < RATIO_BOUND * unit, (ours, unit)
    assert len(stubbed_graph) == 1            # every call after the first hit the cache


def test_planted_config_patch_exceeds_the_bound(stubbed_graph, monkeypatch):
    """A config-patch context manager entered on every call (what used to be there) is
    caught by the bound above."""
    import torch._inductor.config as inductor_config
    original = graph.compiled_backward.__wrapped__ \
        if hasattr(graph.compiled_backward, "__wrapped__") else None
    assert original is not None

    def patched(inputs, **kwargs):
        with inductor_config.patch({"epilogue_fusion": False, "max_autotune": False,
                                    "triton.cudagraphs": False}), \
                torch._dynamo.config.patch(cache_size_limit=8):
            return original(inputs, **kwargs)

    from vitattn_bwd import api
    monkeypatch.setattr(api, "compiled_backward", patched)
    call = _our_part(3)
    call()
    ours, unit = _timed(call)
    print(f"planted: {ours:.1f} us, calibration {unit:.1f} us (ratio {ours / unit:.1f})")
    assert ours > RATIO_BOUND * unit, (ours, unit)


def test_planted_extra_pass_over_the_data_exceeds_the_bound(stubbed_graph):
    """One extra pass over every input (check_finite=True does exactly that) is caught."""
    call = _our_part(3, check_finite=True)
    call()
    ours, unit = _timed(call)
    print(f"planted: {ours:.1f} us, calibration {unit:.1f} us (ratio {ours / unit:.1f})")
    assert ours > RATIO_BOUND * unit, (ours, unit)
