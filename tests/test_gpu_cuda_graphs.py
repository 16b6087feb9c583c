"""cuda_graphs.GraphedCall on a CUDA GPU (gpu marker): replays equal direct calls for
inputs at fresh addresses, outputs are the caller's own (a later replay leaves them
alone), one graph per input signature, and replays from worker threads and other streams
are ordered after each other."""
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


def test_one_graph_per_signature():
    graphed = GraphedCall(_product_and_sum)
    for n in (32, 64, 32, 64):
        got = graphed(**_inputs(n, n))
        assert got[0].shape == (n, n)
        assert torch.equal(got[0], _product_and_sum(**_inputs(n, n))[0])
    assert len(graphed._graphs) == 2


def test_replays_from_threads_and_streams():
    graphed = GraphedCall(_product_and_sum)
    graphed(**_inputs(0))
    want = {seed: _product_and_sum(**_inputs(seed)) for seed in range(8)}
    got, errors = {}, []

    def worker(seed):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(20):
                    result = graphed(**_inputs(seed))
                torch.cuda.current_stream().synchronize()
            got[seed] = result
        except Exception as error:                    # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed in range(8):
        assert all(torch.equal(g, w) for g, w in zip(got[seed], want[seed])), seed
