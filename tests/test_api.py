"""attention_block_backward and contract.run on the CPU: the compiled graph against the
float64 reference, argument checking, no mutation, one graph for many batch sizes."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import vitattn_bwd
from vitattn_bwd import contract
from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs

from .helpers import reference_grads, relative_errors


def _inputs(B, S, H, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return make_inputs(B, seq_len=S, embed_dim=H * D, num_heads=H, dtype=dtype, generator=g)


@given(B=st.integers(1, 4), S=st.sampled_from([1, 2, 7, 16, 31, 53, 64, 79, 80]),
       H=st.integers(1, 4), D=st.sampled_from([8, 16, 32, 64]),
       ln_grad=st.sampled_from(["exact", "contract"]), seed=st.integers(0, 2 ** 16))
def test_compiled_matches_float64_reference(B, S, H, D, ln_grad, seed):
    inputs = _inputs(B, S, H, D, seed=seed)
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=H, ln_grad=ln_grad)
    refs = reference_grads(inputs, H, ln_grad)
    for name, err in zip(OUTPUT_NAMES, relative_errors(grads, refs)):
        assert err < 1e-5, (name, err)


def test_float64_matches_reference_to_rounding():
    inputs = _inputs(2, 19, 2, 8, dtype=torch.float64)
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    for name, err in zip(OUTPUT_NAMES, relative_errors(grads, reference_grads(inputs, 2,
                                                                              "exact"))):
        assert err < 1e-12, (name, err)


def test_contract_run_is_the_contract_mode_in_contract_order():
    inputs = _inputs(3, 17, 2, 16)
    out = contract.run(*inputs.values())
    assert type(out) is tuple and len(out) == 7
    for name, err in zip(OUTPUT_NAMES, relative_errors(out, reference_grads(inputs, 2,
                                                                            "contract"))):
        assert err < 1e-5, (name, err)


def test_non_contiguous_inputs_give_the_same_result():
    inputs = _inputs(2, 11, 2, 8)
    expected = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    strided = dict(inputs)
    for name in ("q", "k", "v"):             # head-major values held sequence-major
        strided[name] = inputs[name].transpose(1, 2).contiguous().transpose(1, 2)
    strided["qkv_weight"] = inputs["qkv_weight"].t().contiguous().t()
    assert not strided["q"].is_contiguous()
    got = vitattn_bwd.attention_block_backward(**strided, num_heads=2)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_inputs_are_not_modified_and_outputs_do_not_alias_them():
    inputs = _inputs(2, 9, 2, 8)
    before = {k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)}
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    for name, saved in before.items():
        assert torch.equal(inputs[name], saved), name
    input_storages = {t.untyped_storage().data_ptr() for t in before.values()} | {
        inputs[k].untyped_storage().data_ptr() for k in before}
    for name, g in zip(OUTPUT_NAMES, grads):
        assert g.untyped_storage().data_ptr() not in input_storages, name


def test_batch_sizes_share_one_compiled_graph_per_bucket():
    counters = torch._dynamo.utils.counters["stats"]

    def inputs_of(B):                     # scale 0.37: a configuration no other test uses
        return {**_inputs(B, 23, 2, 8, seed=B), "scale": 0.37}

    for B in (2, 16):                                 # one graph per batch bucket
        compiled_before = counters["unique_graphs"]
        vitattn_bwd.attention_block_backward(**inputs_of(B), num_heads=2)
        assert counters["unique_graphs"] == compiled_before + 1, B
    compiled_before = counters["unique_graphs"]
    # more sizes per bucket than dynamo's default recompile limit of 8
    for B in (3, 4, 7, 12, 5, 2, 9, 15, 11, 6, 17, 31, 16, 24):
        inputs = inputs_of(B)
        grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
        assert max(relative_errors(grads, reference_grads(inputs, 2, "exact"))) < 1e-5
    assert counters["unique_graphs"] == compiled_before


def test_cuda_graphs_only_for_batch_one_on_the_main_thread(monkeypatch):
    import threading
    from vitattn_bwd.graph import batch_bucket, compile_mode
    monkeypatch.delenv("VITATTN_BWD_COMPILE_MODE", raising=False)
    assert compile_mode("cpu", None) is None
    assert compile_mode("cuda", None) == "max-autotune"
    assert compile_mode("cuda", batch_bucket(2)) == "max-autotune-no-cudagraphs"
    in_thread = []                       # where autograd runs a CUDA backward
    worker = threading.Thread(target=lambda: in_thread.append(compile_mode("cuda", None)))
    worker.start()
    worker.join()
    assert in_thread == ["max-autotune-no-cudagraphs"]
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")
    assert compile_mode("cuda", None) == "default"


def test_batch_buckets_cover_every_batch_size_once():
    from vitattn_bwd.graph import batch_bucket
    assert batch_bucket(1) is None
    assert [batch_bucket(B)[0] for B in (2, 15, 16, 56, 10_000)] == [2, 2, 16, 16, 16]


def test_grad_matches_reference_with_nonstandard_scale_and_eps():
    inputs = _inputs(2, 10, 2, 8)
    inputs.update(scale=0.3, norm_eps=1e-3)
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    assert max(relative_errors(grads, reference_grads(inputs, 2, "exact"))) < 1e-5


def _bad(change):
    inputs = _inputs(2, 5, 2, 8)
    kwargs = dict(num_heads=2)
    change(inputs, kwargs)
    return inputs, kwargs


BAD_INPUTS = [
    ("x", TypeError, lambda i, k: i.update(x=i["x"].numpy())),
    ("q", ValueError, lambda i, k: i.update(q=i["q"][:, :, :4])),
    ("attn_weights", ValueError, lambda i, k: i.update(attn_weights=i["attn_weights"][0])),
    ("x_var", ValueError, lambda i, k: i.update(x_var=i["x_var"].squeeze(-1))),
    ("qkv_weight", ValueError, lambda i, k: i.update(qkv_weight=i["qkv_weight"].t())),
    ("k", TypeError, lambda i, k: i.update(k=i["k"].double())),
    ("x", TypeError, lambda i, k: [i.update({n: t.half()}) for n, t in list(i.items())
                                   if torch.is_tensor(t)]),
    ("x", ValueError, lambda i, k: i.update(x=i["x"][0])),
    ("num_heads", ValueError, lambda i, k: k.update(num_heads=3)),
    ("num_heads", ValueError, lambda i, k: k.update(num_heads=0)),
    ("scale", ValueError, lambda i, k: i.update(scale=math.nan)),
    ("scale", TypeError, lambda i, k: i.update(scale=torch.tensor(0.5))),
    ("norm_eps", ValueError, lambda i, k: i.update(norm_eps=math.inf)),
    ("norm_eps", ValueError, lambda i, k: i.update(norm_eps=-1.0)),
    ("ln_grad", ValueError, lambda i, k: k.update(ln_grad="true")),
    ("attn_weights", ValueError, lambda i, k: k.update(check_finite=True)
     or i["attn_weights"].__setitem__((0, 0, 0, 0), math.nan)),
]


@pytest.mark.parametrize("argument,error,change", BAD_INPUTS,
                         ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_an_error_naming_the_argument(argument, error, change):
    inputs, kwargs = _bad(change)
    with pytest.raises(error, match=argument):
        vitattn_bwd.attention_block_backward(**inputs, **kwargs)


def test_nan_inputs_propagate_by_default():
    inputs = _inputs(2, 5, 2, 8)
    inputs["x_norm"][1, 2, 3] = math.nan
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    assert grads.grad_qkv_weight.isnan().any()


def test_tensors_on_two_devices_are_rejected():
    inputs = _inputs(1, 3, 1, 8)
    inputs["ln_weight"] = inputs["ln_weight"].to("meta")
    with pytest.raises(ValueError, match="ln_weight"):
        vitattn_bwd.attention_block_backward(**inputs, num_heads=1)
