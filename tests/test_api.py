"""attention_block_backward and contract.run on the CPU: the compiled graph against the
float64 reference, argument checking, no mutation, one graph for many batch sizes."""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import vitattn_bwd
from vitattn_bwd import contract
from vitattn_bwd.workloads import OUTPUT_NAMES

from .helpers import assert_within_bounds, make_case
from .strategies import profile_examples


# Each example at a new (S, H, D) is an Inductor compile (~15 s on 2 CPU cores): under the
# ci profile one wide explicit case and two drawn ones (tests/test_properties.py's
# compiled-CPU property draws more shapes against the same float64 bounds).
@settings(max_examples=profile_examples(2))
@example(B=3, S=79, H=4, D=32, ln_grad="contract", seed=11)
@given(B=st.integers(1, 4), S=st.sampled_from([1, 2, 7, 16, 31, 53, 64, 79, 80]),
       H=st.integers(1, 4), D=st.sampled_from([8, 16, 32, 64]),
       ln_grad=st.sampled_from(["exact", "contract"]), seed=st.integers(0, 2 ** 16))
def test_compiled_matches_float64_reference(B, S, H, D, ln_grad, seed):
    inputs = make_case(B, S, H, D, seed=seed)
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=H, ln_grad=ln_grad)
    assert_within_bounds(grads, inputs, H, ln_grad)


def test_float64_matches_reference_to_rounding():
    inputs = make_case(2, 19, 2, 8, dtype=torch.float64)
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    assert grads.grad_x.dtype == torch.float64
    assert_within_bounds(grads, inputs, 2, "exact")          # the float64 row: 1e-12


def test_contract_run_is_the_contract_mode_in_contract_order():
    inputs = make_case(3, 17, 2, 16)
    out = contract.run(*inputs.values())
    assert type(out) is tuple and len(out) == 7
    assert_within_bounds(out, inputs, 2, "contract")


def test_non_contiguous_inputs_give_the_same_result():
    inputs = make_case(2, 11, 2, 8)
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
    inputs = make_case(2, 9, 2, 8)
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
        return {**make_case(B, 23, 2, 8, seed=B), "scale": 0.37}

    for B in (2, 16):                                 # one graph per batch bucket
        compiled_before = counters["unique_graphs"]
        vitattn_bwd.attention_block_backward(**inputs_of(B), num_heads=2)
        assert counters["unique_graphs"] == compiled_before + 1, B
    compiled_before = counters["unique_graphs"]
    # more sizes per bucket than dynamo's default recompile limit of 8
    for B in (3, 4, 7, 12, 5, 2, 9, 15, 11, 6, 17, 31, 16, 24):
        inputs = inputs_of(B)
        grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
        assert_within_bounds(grads, inputs, 2, "exact")
    assert counters["unique_graphs"] == compiled_before


def _in_a_thread(fn):
    """fn() on a fresh thread; its result, or its exception raised here."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def test_cuda_graphs_for_small_batches_on_every_thread():
    from vitattn_bwd.graph import CUDA_GRAPH_MAX_BATCH, uses_cuda_graph
    assert not uses_cuda_graph("cpu", 1)
    assert uses_cuda_graph("cuda", 1) and uses_cuda_graph("cuda", CUDA_GRAPH_MAX_BATCH)
    assert not uses_cuda_graph("cuda", CUDA_GRAPH_MAX_BATCH + 1)
    # where autograd runs a CUDA backward: a thread other than the main one
    assert _in_a_thread(lambda: uses_cuda_graph("cuda", 1))


def test_batch_buckets_cover_every_batch_size_once():
    from vitattn_bwd.graph import batch_bucket
    assert batch_bucket(1) is None
    assert [batch_bucket(B)[0] for B in (2, 15, 16, 56, 10_000)] == [2, 2, 16, 16, 16]


def test_grad_matches_reference_with_nonstandard_scale_and_eps():
    inputs = make_case(2, 10, 2, 8)
    inputs.update(scale=0.3, norm_eps=1e-3)
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    assert_within_bounds(grads, inputs, 2, "exact")


def _bad(change):
    inputs = make_case(2, 5, 2, 8)
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
    ("precision", ValueError, lambda i, k: k.update(precision="medium")),
    ("attn_weights", ValueError, lambda i, k: k.update(check_finite=True)
     or i["attn_weights"].__setitem__((0, 0, 0, 0), math.nan)),
]


@pytest.mark.parametrize("argument,error,change", BAD_INPUTS,
                         ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_an_error_naming_the_argument(argument, error, change):
    inputs, kwargs = _bad(change)
    with pytest.raises(error, match=argument):
        vitattn_bwd.attention_block_backward(**inputs, **kwargs)


def test_precision_highest_is_accepted_and_plain_on_the_cpu():
    """The contract entry point runs "high" whatever torch's setting; "highest" is
    accepted, and on the CPU both are the same plain float32 math."""
    inputs = make_case(2, 5, 2, 8)
    high = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    highest = vitattn_bwd.attention_block_backward(**inputs, num_heads=2,
                                                   precision="highest")
    assert all(torch.equal(a, b) for a, b in zip(high, highest))


def test_nan_inputs_propagate_by_default():
    inputs = make_case(2, 5, 2, 8)
    inputs["x_norm"][1, 2, 3] = math.nan
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    assert grads.grad_qkv_weight.isnan().any()


def test_tensors_on_two_devices_are_rejected():
    inputs = make_case(1, 3, 1, 8)
    inputs["ln_weight"] = inputs["ln_weight"].to("meta")
    with pytest.raises(ValueError, match="ln_weight"):
        vitattn_bwd.attention_block_backward(**inputs, num_heads=1)


# contract.run reads num_heads from q's dim 1: a wrong q must be blamed on q, before that.
@pytest.mark.parametrize("change,error,message", [
    (lambda q: None, TypeError, r"q must be a torch.Tensor .*NoneType"),
    (lambda q: q.flatten(), ValueError, r"q must be 4-D \[B, H, S, D\].*got shape \(160,\)"),
    (lambda q: q.transpose(1, 2).contiguous(), ValueError,
     r"q must be \[B, H, S, D\] \(head-major.*got shape \(2, 5, 2, 8\); that is "
     r"\[B, S, H, D\]: pass q.transpose\(1, 2\)"),
    (lambda q: q[..., :4], ValueError, r"q must be \[B, H, S, D\].*H \* D = 16"),
], ids=["None", "1-D", "sequence-major", "narrow-head-dim"])
def test_contract_run_names_a_bad_q(change, error, message):
    inputs = make_case(2, 5, 2, 8)
    inputs["q"] = change(inputs["q"])
    with pytest.raises(error, match=message) as caught:
        contract.run(*inputs.values())
    assert "x's embed dim" not in str(caught.value)


def test_contract_run_blames_q_where_k_and_v_agree():
    """A q of another head split than k and v (here 1 head of 16 against 2 of 8): q is
    where contract.run reads num_heads from, so q is named, not k with a num_heads that
    contract.run does not take."""
    inputs = make_case(2, 5, 2, 8)
    inputs["q"] = inputs["q"].transpose(1, 2).reshape(2, 1, 5, 16)
    with pytest.raises(ValueError, match=r"q must have k's and v's shape \(2, 2, 5, 8\).*"
                       r"got \(2, 1, 5, 16\) \(num_heads is read from q's dim 1\)"):
        contract.run(*inputs.values())


@pytest.mark.parametrize("attribute", ["dtype", "device"])
def test_an_x_unlike_every_other_input_is_the_one_named(attribute):
    """x alone in float64 (or on another device): the error names x, not the first
    other tensor it was compared with."""
    inputs = make_case(2, 5, 2, 8)
    if attribute == "dtype":
        inputs["x"] = inputs["x"].double()
        error, message = TypeError, (r"x has dtype torch.float64, but every other input "
                                     r"has torch.float32")
    else:
        inputs["x"] = inputs["x"].to("meta")
        error, message = ValueError, "x is on meta, but every other input is on cpu"
    with pytest.raises(error, match=message):
        vitattn_bwd.attention_block_backward(**inputs, num_heads=2)


def test_compiled_backward_is_keyed_by_x_device_with_its_index(monkeypatch):
    """graph._compile's key holds x's torch.device, not only its type: dynamo guards on
    the device, so GPUs of one process sharing a compiled graph's code object would
    each add graphs to it, past its recompile limit (8) an error under fullgraph."""
    from vitattn_bwd import graph
    keys = []
    real = graph._compile

    def recorded(*key):
        keys.append(key)
        return real(*key)
    monkeypatch.setattr(graph, "_compile", recorded)
    inputs = make_case(1, 5, 2, 8)
    vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    assert keys and keys[0][0] == torch.device("cpu")
    assert isinstance(keys[0][0], torch.device)


def test_contract_run_names_a_bad_x_not_q():
    inputs = make_case(2, 5, 2, 8)
    inputs["x"] = None
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got NoneType"):
        contract.run(*inputs.values())


def test_default_num_heads_against_other_head_count_names_num_heads():
    inputs = make_case(1, 3, 4, 8)                     # 4 heads of 8; the default is 16
    with pytest.raises(ValueError, match=r"q must have shape \(1, 16, 3, 2\).*got "
                       r"\(1, 4, 3, 8\); it has 4 heads of 8: pass num_heads=4 \(num_heads "
                       r"is 16; its default is 16\)"):
        vitattn_bwd.attention_block_backward(**inputs)


def test_attn_weights_shape_error_mentions_num_heads():
    inputs = make_case(1, 3, 4, 8)
    inputs["attn_weights"] = inputs["attn_weights"][:, :2]
    with pytest.raises(ValueError, match=r"attn_weights .*got \(1, 2, 3, 3\) \(num_heads=4\)"):
        vitattn_bwd.attention_block_backward(**inputs, num_heads=4)


def test_numpy_scalars_are_accepted_as_their_python_values():
    counters = torch._dynamo.utils.counters["stats"]
    inputs = make_case(2, 5, 2, 8)
    inputs.update(scale=np.float32(0.3125), norm_eps=np.float32(2.0 ** -10))
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=np.int64(2))
    compiled = counters["unique_graphs"]
    as_python = dict(inputs, scale=0.3125, norm_eps=2.0 ** -10)
    again = vitattn_bwd.attention_block_backward(**as_python, num_heads=2)
    assert counters["unique_graphs"] == compiled          # the same compiled graph
    for a, b in zip(grads, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_within_bounds(grads, as_python, 2, "exact")
    # and through the benchmark entry point (scale, norm_eps as NumPy float64 and int)
    out = contract.run(*dict(inputs, scale=np.float64(0.3125), norm_eps=np.int32(0)).values())
    assert_within_bounds(out, dict(as_python, norm_eps=0.0), 2, "contract")


@pytest.mark.parametrize("argument,value", [
    ("num_heads", True), ("num_heads", np.True_), ("num_heads", torch.tensor(2)),
    ("num_heads", "2"), ("num_heads", 2.0), ("num_heads", np.float32(2)),
    ("scale", True), ("scale", "0.5"), ("scale", torch.tensor(0.5)), ("scale", np.True_),
    ("scale", np.array([0.5])), ("scale", None), ("scale", 0.5j),
    ("norm_eps", b"1e-5"), ("norm_eps", torch.tensor(1e-5, dtype=torch.float64)),
])
def test_wrong_scalar_types_raise_type_error_naming_the_argument(argument, value):
    inputs = make_case(2, 5, 2, 8)
    kwargs = dict(num_heads=2)
    (kwargs if argument == "num_heads" else inputs)[argument] = value
    with pytest.raises(TypeError, match=f"^{argument} must be"):
        vitattn_bwd.attention_block_backward(**inputs, **kwargs)


def test_argument_checks_do_no_tensor_work():
    """The checks run on every call: they look at shapes and types only. Counted, not
    timed: the tensor operations dispatched while they run are detaches (a view of each
    input, no data read); an added pass over the inputs, or a copy, would dispatch
    others."""
    from tests.helpers import dispatched_ops
    from vitattn_bwd.validation import check_backward_inputs

    inputs = make_case(2, 9, 4, 16)
    tensors = {k: v for k, v in inputs.items() if torch.is_tensor(v)}
    args = (tensors, np.float32(0.125), 1e-5, np.int64(4), "exact", "high")
    with dispatched_ops() as ops:
        checked, scale, norm_eps, num_heads = check_backward_inputs(*args)
    assert set(ops.names) <= {"aten.detach.default"}, ops.names
    assert (type(scale), type(norm_eps), type(num_heads)) == (float, float, int)
    assert scale == 0.125 and num_heads == 4
    assert all(checked[k].data_ptr() == t.data_ptr() for k, t in tensors.items())  # no copy
    with dispatched_ops() as ops:             # check_finite: the one pass, which shows
        check_backward_inputs(*args, True)
    assert not set(ops.names) <= {"aten.detach.default"}, ops.names


def test_contract_precision_high_past_its_rows_runs_highest():
    """With P given, "high" runs "highest" past HIGH_PRECISION_MAX_ROWS rows (the
    contract's margins at big batches, tests/test_gpu_properties.py); the module's
    log-sum-exp path and an explicit "highest" are unchanged, and the CPU runs plain
    products."""
    from vitattn_bwd.graph import HIGH_PRECISION_MAX_ROWS, products_for
    from vitattn_bwd.precision import Products
    high, highest = Products.BF16X3, Products.FP16X3
    rows = HIGH_PRECISION_MAX_ROWS
    assert products_for("cuda", high, rows, True) == high
    assert products_for("cuda", high, rows + 1, True) == highest
    assert products_for("cuda", high, rows + 1, False) == high
    assert products_for("cuda", highest, 1, True) == highest
    assert products_for("cpu", high, rows + 1, True) is Products.PLAIN
