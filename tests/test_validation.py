"""vitattn_bwd.validation through the entry points: the backward alone, the block, its
functional form and autograd Function, and the contract word the same bad argument
alike, and refuse it at the call (no compile, no backward). The argument checks of each
entry point on their own: tests/test_api.py and tests/test_module.py."""
import numpy as np
import pytest
import torch

import vitattn_bwd
from vitattn_bwd import VisionAttentionBlock, contract
from vitattn_bwd.module import VisionAttentionFunction, vision_attention
from vitattn_bwd.validation import (check_config, check_float,
                                    check_positive_int)

from .helpers import make_case

E, H = 16, 2


def _refusal(call):
    """(type, message) of what `call()` raises; fails the test if it returns."""
    with pytest.raises((TypeError, ValueError)) as raised:
        call()
    return type(raised.value), str(raised.value)


def _block_params():
    return [p.detach() for p in VisionAttentionBlock(E, H).parameters()]


@pytest.mark.parametrize("num_heads", [0, -2, 3, 2.0, True, np.float32(2), "2",
                                       torch.tensor(2)])
def test_backward_and_block_word_a_bad_num_heads_alike(num_heads):
    inputs = make_case(1, 3, H, E // H)
    backward = _refusal(lambda: vitattn_bwd.attention_block_backward(
        **inputs, num_heads=num_heads))
    construction = _refusal(lambda: VisionAttentionBlock(E, num_heads))
    functional = _refusal(lambda: vision_attention(torch.randn(1, 3, E), *_block_params(),
                                                   num_heads, 1e-5))
    assert construction == functional
    assert backward[0] is construction[0]
    # the backward's width is x's: its message says so after the block's
    assert backward[1].startswith(construction[1]), (backward, construction)
    assert construction[1].startswith("num_heads")


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), "1e-5", None,
                                 torch.tensor(1e-5), np.array([1e-5]), 1e-5j])
def test_backward_norm_eps_and_block_eps_are_worded_alike(eps):
    inputs = make_case(1, 3, H, E // H)
    backward = _refusal(lambda: vitattn_bwd.attention_block_backward(
        **dict(inputs, norm_eps=eps), num_heads=H))
    construction = _refusal(lambda: VisionAttentionBlock(E, H, eps=eps))
    functional = _refusal(lambda: vision_attention(torch.randn(1, 3, E), *_block_params(),
                                                   H, eps))
    assert construction == functional
    assert backward == (construction[0], "norm_" + construction[1])


_WEIGHTS = ("ln_weight", "qkv_weight", "out_weight")                 # no batch, no tokens


@pytest.mark.parametrize("empty", ["batch", "tokens", "width"])
def test_the_backward_refuses_an_empty_batch_sequence_or_width_naming_x(empty):
    """The contract's backward with B, S or E = 0 (every tensor cut to match): refused
    by name at the call, as batch 0 was and width 0 was not (it returned empty
    gradients)."""
    inputs = make_case(2, 3, H, E // H)

    def cut(name, t):
        if not torch.is_tensor(t):
            return t
        if empty == "batch":
            return t if name in _WEIGHTS else t[:0]
        if empty == "tokens":
            if name in _WEIGHTS:
                return t
            return t[:, :, :0] if t.dim() == 4 else t[:, :0]          # [B,H,S,.], [B,S,.]
        if name in ("x_mean", "x_var", "attn_weights"):
            return t
        return t[:0, :0] if name in ("qkv_weight", "out_weight") else t[..., :0]
    inputs = {name: cut(name, t) for name, t in inputs.items()}
    if empty == "tokens":
        inputs["attn_weights"] = inputs["attn_weights"][..., :0]
    assert _refusal(lambda: vitattn_bwd.attention_block_backward(**inputs, num_heads=H)) == (
        ValueError, f"x must have batch, sequence length and embed dim >= 1, got "
                    f"{tuple(inputs['x'].shape)}")


def test_every_entry_point_refuses_a_non_tensor_x_with_a_type_error_naming_x():
    inputs = make_case(1, 3, H, E // H)
    params = _block_params()
    calls = [lambda: vitattn_bwd.attention_block_backward(**dict(inputs, x=None),
                                                          num_heads=H),
             lambda: contract.run(*dict(inputs, x=None).values()),
             lambda: vision_attention(None, *params, H, 1e-5),
             lambda: VisionAttentionFunction.apply(None, *params, H, 1e-5),
             lambda: VisionAttentionBlock(E, H)(None)]
    for call in calls:
        assert _refusal(call) == (TypeError, "x must be a torch.Tensor, got NoneType")


def test_a_wrong_parameter_is_named_with_its_shape_by_the_backward_and_the_block():
    inputs = make_case(1, 3, H, E // H)
    params = _block_params()
    params[2] = params[2][:, :-1]                                   # qkv_weight [3E, E-1]
    want = (ValueError, f"qkv_weight must have shape ({3 * E}, {E}) (3ExE), got "
                        f"({3 * E}, {E - 1})")
    assert _refusal(lambda: vision_attention(torch.randn(1, 3, E), *params, H, 1e-5)) == want
    assert _refusal(lambda: vitattn_bwd.attention_block_backward(
        **dict(inputs, qkv_weight=params[2]), num_heads=H)) == want


def test_scalars_come_back_as_python_values():
    assert type(check_positive_int("num_heads", np.int64(4))) is int
    assert check_positive_int("num_heads", np.int64(4)) == 4
    assert type(check_float("scale", np.float32(0.125))) is float
    assert check_float("scale", np.float32(0.125)) == 0.125
    assert check_float("norm_eps", 0, minimum=0) == 0.0
    assert check_config(np.int32(32), np.int64(4), np.float64(1e-6)) == (32, 4, 1e-6)
    assert [type(v) for v in check_config(np.int32(32), np.int64(4), 0)] == [int, int, float]


def test_sparse_and_mkldnn_tensors_are_refused_by_name_at_every_entry_point():
    """Only dense (strided) tensors are taken: a sparse or MKL-DNN one is refused at the
    call with a TypeError naming it, not deep inside the math (a nested one too:
    test_nested_tensors_are_refused_by_name)."""
    inputs = make_case(1, 3, H, E // H)
    params = _block_params()
    x = torch.randn(1, 3, E)
    calls = [("x", lambda: vitattn_bwd.attention_block_backward(
                 **dict(inputs, x=inputs["x"].to_sparse()), num_heads=H)),
             ("ln_weight", lambda: contract.run(
                 *dict(inputs, ln_weight=inputs["ln_weight"].to_sparse()).values())),
             ("attn_weights", lambda: vitattn_bwd.attention_block_backward(
                 **dict(inputs, attn_weights=inputs["attn_weights"].to_mkldnn()),
                 num_heads=H)),
             ("x", lambda: VisionAttentionBlock(E, H)(x.to_sparse())),
             ("qkv_weight", lambda: vision_attention(
                 x, *params[:2], params[2].to_sparse(), *params[3:], H, 1e-5)),
             ("gamma", lambda: vision_attention(x, *params, H, 1e-5,
                                                gamma=torch.ones(E).to_sparse()))]
    for name, call in calls:
        error, message = _refusal(call)
        assert error is TypeError and message.startswith(
            f"{name} must be a dense (strided) tensor, got layout torch."), message


def test_a_block_on_the_meta_device_is_refused_naming_x():
    """The block computes on real devices: a meta x (a model not yet materialized) is
    refused at the call by name, by the block, its functional form and its Function."""
    block = VisionAttentionBlock(E, H, device="meta")
    x = torch.randn(2, 3, E, device="meta")
    params = [p.detach() for p in block.parameters()]
    for call in (lambda: block(x), lambda: vision_attention(x, *params, H, 1e-5),
                 lambda: VisionAttentionFunction.apply(x, *params, H, 1e-5)):
        error, message = _refusal(call)
        assert error is ValueError and message.startswith("x is on the meta device"), message


def test_swapping_again_at_another_precision_is_refused_naming_precision():
    """A swap skips layers already swapped: asked for another precision than theirs it
    refuses (it would silently keep their old one) and changes nothing; a model that is
    not a module is refused by name."""
    from vitattn_bwd.integrations import _common, swap_attention

    from .test_integrations import TimmStyleVisionTransformer
    model = swap_attention(TimmStyleVisionTransformer())
    with pytest.raises(ValueError, match=r"^precision='high', but blocks\.0 \(None\), "
                                         r"blocks\.1 \(None\) were swapped already"):
        swap_attention(model, precision="high")
    assert [_common.precision_of(block) for block in model.blocks] == [None, None]
    swap_attention(model)                                # the same precision: a no-op
    with pytest.raises(TypeError, match="^model must be a torch.nn.Module, got NoneType"):
        swap_attention(None)


def test_nested_tensors_are_refused_by_name():
    """A nested tensor (strided or jagged layout) is refused at the call, naming it,
    with the padding that makes it one tensor."""
    block = VisionAttentionBlock(E, H)
    for layout in (torch.strided, torch.jagged):
        x = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)], layout=layout)
        error, message = _refusal(lambda: block(x))
        assert error is TypeError and message.startswith(
            "x must be a dense tensor, got a nested tensor"), message
