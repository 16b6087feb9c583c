"""cuda_graphs.GraphedCall on a CUDA GPU (gpu marker): replays equal direct calls for
inputs at fresh addresses, the first call returns the graph's bits, outputs are the
caller's own (a later replay leaves them alone), one graph per input signature, replays
from worker threads and other streams are ordered after each other, a graph captured in
inference mode serves later calls, a failed capture falls back to direct calls, and
inputs on a GPU other than the current one (two GPUs) are computed there."""
import threading

import pytest
import torch

from vitattn_bwd.cuda_graphs import GraphedCall

pytestmark = pytest.mark.gpu


def _product_and_sum(a, b):
    return a @ b, (a * 2).sum(0)


def _inputs(seed, n=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return dict(a=torch.randn(n, n, device="cuda", generator=g),
                b=torch.randn(n, n, device="cuda", generator=g))


def test_replays_equal_direct_calls_and_outputs_are_not_overwritten():
    graphed = GraphedCall(_product_and_sum)
    results = [graphed(**_inputs(seed)) for seed in range(4)]       # 1 run + 3 replays
    for seed, got in enumerate(results):
        want = _product_and_sum(**_inputs(seed))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), seed
    assert len(graphed._graphs) == 1


def test_the_first_call_returns_the_graphs_bits():
    """fn's direct runs and its graph may differ in bits (here: a Python counter that
    each run bakes into its kernels, as a recompile with other autotune choices would);
    the first call of a signature returns what its replays return."""
    runs = []

    def counted(a):
        runs.append(None)
        return (a + len(runs),)                 # 1: the direct run; 3: the captured one
    graphed = GraphedCall(counted)
    a = _inputs(0)["a"]
    results = [graphed(a=a)[0] for _ in range(3)]
    assert len(runs) == 3                       # direct, warm-up on the static copies, capture
    assert all(torch.equal(r, a + 3) for r in results)


def test_inside_a_callers_capture_its_kernels_go_into_the_callers_graph():
    """A GraphedCall whose signature already has a graph of its own, called while the
    caller captures (as torch.compile's CUDA graphs do around our operators): no replay
    inside the capture (not allowed there), fn's kernels in the caller's graph, whose
    replays compute fn on the values copied into its inputs."""
    graphed = GraphedCall(_product_and_sum)
    for seed in range(2):
        graphed(**_inputs(seed))                       # run, capture our own graph
    static = _inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed(**static)                              # a warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    theirs = torch.cuda.CUDAGraph()
    with torch.cuda.graph(theirs):
        outputs = graphed(**static)
    for seed in (3, 4):
        for name, t in _inputs(seed).items():
            static[name].copy_(t)
        theirs.replay()
        want = _product_and_sum(**_inputs(seed))
        assert all(torch.equal(g, w) for g, w in zip(outputs, want)), seed
    assert len(graphed._graphs) == 1


def test_one_graph_per_signature():
    graphed = GraphedCall(_product_and_sum)
    for n in (32, 64, 32, 64):
        got = graphed(**_inputs(n, n))
        assert got[0].shape == (n, n)
        assert torch.equal(got[0], _product_and_sum(**_inputs(n, n))[0])
    assert len(graphed._graphs) == 2


def test_replays_from_threads_and_streams():
    """Eight threads, each on a stream of its own, replay one graph 20 times with their
    own inputs; inputs large enough (1024 x 1024) that the host runs ahead of the GPU, so
    a replay not ordered after the previous one would read another thread's inputs.
    Every result is checked."""
    n = 1024
    graphed = GraphedCall(_product_and_sum)
    graphed(**_inputs(0, n))
    want = {seed: _product_and_sum(**_inputs(seed, n)) for seed in range(8)}
    mismatches, errors = [], []

    def worker(seed):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                results = [graphed(**_inputs(seed, n)) for _ in range(20)]
                torch.cuda.current_stream().synchronize()
            mismatches.extend((seed, i) for i, got in enumerate(results)
                              if not all(torch.equal(g, w) for g, w in zip(got, want[seed])))
        except Exception as error:                    # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not mismatches, mismatches


def test_first_call_in_inference_mode_then_outside_it():
    """An eval pass under torch.inference_mode captures the graph; a later training-time
    call outside it copies into the same static buffers."""
    graphed = GraphedCall(_product_and_sum)
    with torch.inference_mode():
        graphed(**_inputs(0))
    got = graphed(**_inputs(1))
    assert all(torch.equal(g, w) for g, w in zip(got, _product_and_sum(**_inputs(1))))


_FAILED_CAPTURE = """
import warnings, torch
from vitattn_bwd.cuda_graphs import GraphedCall

def with_host_sync(a, b):
    return a @ b, a.sum(0) * float(b[0, 0])          # a host sync: cannot be captured

def inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return dict(a=torch.randn(64, 64, device="cuda", generator=g),
                b=torch.randn(64, 64, device="cuda", generator=g))

graphed = GraphedCall(with_host_sync)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    graphed(**inputs(0))
got = graphed(**inputs(1))
want = with_host_sync(**inputs(1))
print("warned", any("CUDA graph capture failed" in str(w.message) for w in caught))
print("equal", all(torch.equal(g, w) for g, w in zip(got, want)))
print("direct", list(graphed._graphs.values()) == [None])
"""


def test_a_failed_capture_falls_back_to_direct_calls():
    """In a process of its own (a failed capture must not touch the other tests' CUDA
    context): the failure is a warning, and the signature then runs directly."""
    import subprocess
    import sys
    from pathlib import Path
    result = subprocess.run([sys.executable, "-c", _FAILED_CAPTURE], capture_output=True,
                            text=True, timeout=300,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-6:] == ["warned", "True", "equal", "True", "direct",
                                          "True"], result.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inputs_on_a_gpu_that_is_not_the_current_one():
    graphed = GraphedCall(_product_and_sum)
    for seed in range(3):
        inputs = {name: t.to("cuda:1") for name, t in _inputs(seed).items()}
        got = graphed(**inputs)
        want = _product_and_sum(**inputs)
        assert got[0].device == torch.device("cuda:1")
        assert all(torch.equal(g, w) for g, w in zip(got, want)), seed
